"""The ``radixcache`` command line: ``kv-size`` (KV-cache sizing table), ``demo`` and ``serve``."""

from __future__ import annotations

import argparse
import sys

from radixcache import sizing

DEFAULT_DTYPES = ("bf16", "fp16", "fp8")


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a clear usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="radixcache",
                                     description="Prefix caching for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    kv = commands.add_parser("kv-size", help="KV-cache bytes per token, per sequence and per batch",
                             description="Print KV-cache sizes for model shapes (default: every preset).")
    kv.add_argument("--model", action="append", metavar="PATH",
                    help="local Hugging Face model directory (reads its config.json); repeatable")
    kv.add_argument("--preset", action="append", metavar="NAME",
                    help=f"preset shape, repeatable; one of: {', '.join(sizing.PRESETS)}")
    kv.add_argument("--context", type=positive_int, default=8192, metavar="N",
                    help="tokens per sequence (default 8192)")
    kv.add_argument("--sequences", type=positive_int, default=1, metavar="N",
                    help="sequences held at once (default 1)")
    kv.add_argument("--dtype", action="append", choices=sorted(sizing.DTYPE_BYTES),
                    help=f"cache dtype, repeatable (default: {' '.join(DEFAULT_DTYPES)})")
    kv.set_defaults(handler=lambda args: _kv_size(args, kv))

    demo = commands.add_parser("demo", help="run the multi-turn prefix-caching demo",
                               description="Run the demo on the default SmolLM2 model or a local model.")
    demo.add_argument("--model", metavar="PATH", default=None,
                      help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    demo.add_argument("--turns", type=positive_int, default=6, metavar="N",
                      help="conversation turns (default 6)")
    demo.add_argument("--out", default="out/", metavar="DIR", help="output directory (default out/)")
    demo.set_defaults(handler=_demo)

    from radixcache.integrations.serve import options as serve_options

    serve = commands.add_parser("serve", help="run the OpenAI-compatible server",
                                description="Serve a model over an OpenAI-compatible HTTP API "
                                            "(/v1/chat/completions, /v1/completions, /v1/models, "
                                            "/health, /metrics).")
    serve_options.add_arguments(serve)
    serve.set_defaults(handler=_serve)
    return parser


def _serve(args) -> int:
    from radixcache.integrations.serve.server import main as serve_main

    return serve_main(args)


def _kv_size(args, parser) -> int:
    shapes = []
    try:
        shapes += [sizing.from_model_dir(path) for path in args.model or ()]
        shapes += [sizing.preset(name) for name in args.preset or ()]
    except ValueError as exc:
        parser.error(str(exc))
    if not shapes:
        shapes = list(sizing.PRESETS.values())
    rows = sizing.kv_size_table(shapes, args.context, args.sequences, args.dtype or DEFAULT_DTYPES)
    print(f"KV cache at {args.context:,} tokens per sequence, {args.sequences:,} sequence(s); binary units")
    print(sizing.render_kv_table(rows))
    return 0


def _demo(args) -> int:
    try:
        from radixcache.demo import main as demo_main
    except ModuleNotFoundError as exc:
        if exc.name != "radixcache.demo":
            raise
        print("radixcache: the demo is not available in this version", file=sys.stderr)
        return 1
    demo_args = argparse.Namespace(model=args.model, turns=args.turns, out=args.out)
    result = demo_main(demo_args)
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Usage errors exit with status 2 through argparse.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
