"""The ``radixcache`` command line: ``kv-size`` (KV-cache sizing table), ``demo`` and ``serve``."""

from __future__ import annotations

import argparse
import re
import sys

from radixcache import __version__, models
from radixcache.app import kv_size, kv_size_table
from radixcache.args import positive_int

DEFAULT_DTYPES = ("fp32", "bf16", "fp16", "fp8")  # fp32: what the embedded model runs in on CPU

_KIB = 1024
# Binary multipliers: "128k" tokens = 131,072; "65G" = "65GiB" = 65 x 2**30 bytes.
TOKEN_SUFFIXES = {"": 1, "k": _KIB, "ki": _KIB, "m": _KIB**2, "mi": _KIB**2}
BYTE_SUFFIXES = {"b": 1, "k": _KIB, "ki": _KIB, "kib": _KIB, "m": _KIB**2, "mi": _KIB**2, "mib": _KIB**2,
                 "g": _KIB**3, "gi": _KIB**3, "gib": _KIB**3, "t": _KIB**4, "ti": _KIB**4, "tib": _KIB**4}
# Past these, a size describes no machine: refused rather than printed as thousands of PiB.
MAX_CONTEXT = 2**32  # tokens per sequence
MAX_SEQUENCES = 2**32
MAX_BYTES = 2**60  # 1 EiB: --memory, and the KV of all sequences together
_NUMBER = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([A-Za-z]*)\s*")


def _scaled(text: str, suffixes: dict, default: str, unit: str) -> int:
    """``text`` = a decimal number and an optional suffix from ``suffixes``, as a whole count."""
    match = _NUMBER.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a number with an optional unit, got {text!r}")
    whole, frac, suffix = match.group(1), match.group(2) or "", match.group(3).lower() or default
    if suffix in ("kb", "mb", "gb", "tb"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is ambiguous: write binary units ({suffix[0].upper()} or {suffix[0].upper()}iB)")
    if suffix not in suffixes:
        known = ", ".join(s for s in suffixes if s)
        raise argparse.ArgumentTypeError(f"unknown unit {suffix!r} in {text!r} (binary units: {known})")
    scaled = int(whole + frac) * suffixes[suffix]
    if scaled % 10 ** len(frac):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {unit}")
    return scaled // 10 ** len(frac)


def token_count(text: str) -> int:
    """An argparse type: a token count >= 1, with an optional binary suffix ("8192", "8k" = 8,192,
    "128k" = 131,072, "1M" = 1,048,576; case-insensitive)."""
    value = _scaled(text, TOKEN_SUFFIXES, "", "tokens")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    if value > MAX_CONTEXT:
        raise argparse.ArgumentTypeError(f"{text!r} is {value:,} tokens; at most {MAX_CONTEXT:,} "
                                         "(4096M) tokens per sequence")
    return value


def memory_size(text: str) -> int:
    """An argparse type: bytes of KV memory in binary units ("65G" = "65GiB" = 65 x 2**30; a bare
    number is GiB; K/M/G/T with or without "iB", and B). Decimal units (GB, MB) are refused."""
    value = _scaled(text, BYTE_SUFFIXES, "g", "bytes")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a memory size > 0, got {text!r}")
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {kv_size_table.format_bytes(MAX_BYTES)}, "
                                         "more memory than any machine has")
    return value


def sequence_count(text: str) -> int:
    """argparse type: a number of sequences, 1 .. ``MAX_SEQUENCES``."""
    value = positive_int(text)
    if value > MAX_SEQUENCES:
        raise argparse.ArgumentTypeError(f"{value:,} sequences; at most {MAX_SEQUENCES:,}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="radixcache",
                                     description="Prefix caching for Hugging Face causal LMs.")
    parser.add_argument("--version", action="version", version=f"radixcache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    kv = commands.add_parser("kv-size", help="KV-cache bytes per token, per sequence and per batch",
                             description="Print KV-cache sizes for model shapes (default: every preset).")
    kv.add_argument("--model", action="append", metavar="PATH",
                    help="local Hugging Face model directory (reads its config.json); repeatable")
    kv.add_argument("--preset", action="append", metavar="NAME",
                    help=f"preset shape, repeatable; one of: {', '.join(kv_size.PRESETS)}")
    kv.add_argument("--context", type=token_count, default=8192, metavar="N",
                    help="tokens per sequence; k and M are binary (128k = 131,072; default 8192)")
    kv.add_argument("--sequences", type=sequence_count, default=1, metavar="N",
                    help="sequences held at once (default 1)")
    kv.add_argument("--dtype", action="append", choices=sorted(kv_size.DTYPE_BYTES),
                    help=f"cache dtype, repeatable (default: {' '.join(DEFAULT_DTYPES)})")
    kv.add_argument("--memory", type=memory_size, default=None, metavar="SIZE",
                    help="KV memory to fill, in GiB (65, 65G or 65GiB): adds how many sequences fit")
    kv.set_defaults(handler=lambda args: _kv_size(args, kv))

    demo = commands.add_parser("demo", help="run the multi-turn prefix-caching demo",
                               description="Run the demo on the default SmolLM2 model or a local model.")
    demo.add_argument("--model", metavar="PATH", default=None,
                      help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    demo.add_argument("--turns", type=positive_int, default=6, metavar="N",
                      help="conversation turns (default 6)")
    demo.add_argument("--out", default="out/", metavar="DIR", help="output directory (default out/)")
    demo.add_argument("--threads", type=positive_int, default=None, metavar="N",
                      help="torch threads (default: OMP_NUM_THREADS when set, else the CPUs this process may use, "
                           "its affinity and cgroup quota)")
    demo.add_argument("--dtype", choices=models.DTYPE_CHOICES, default="auto",
                      help="the model's dtype, both sides (default auto: bfloat16 on CPUs with native bf16 "
                           "matrix units, AMX / AVX512-BF16 / Arm BF16, and on CUDA; float32 elsewhere)")
    demo.add_argument("--quantize", choices=("int8",), default=None,
                      help="int8 weight-only weights on both sides (torchao, radixcache's [quantize] extra); "
                           "prints the greedy agreement with the unquantized model")
    demo.add_argument("--compile", action="store_true",
                      help="radixcache's side through torch.compile (wrap(model, compile=True)), compiled before "
                           "the first turn (minutes on a CPU, the time printed); plain generate stays eager")
    demo.set_defaults(handler=_demo)

    from radixcache.integrations.serve import options as serve_options

    serve = commands.add_parser(
        "serve", help="run the OpenAI- and Anthropic-compatible server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a model over HTTP with a radix cache under every request.\n\nroutes:\n"
                    "  POST /v1/chat/completions   OpenAI chat completions (tools, structured output, streams)\n"
                    "  POST /v1/completions        OpenAI completions (text or token ids)\n"
                    "  POST /v1/responses          OpenAI Responses; GET / DELETE /v1/responses/{id}\n"
                    "  POST /v1/messages           Anthropic Messages (Claude Code); POST /v1/messages/count_tokens\n"
                    "  GET  /v1/models, /v1/loads  the served models; the load SGLang's model gateway polls\n"
                    "  GET  /health, /metrics      liveness; Prometheus metrics (vLLM's names too)\n"
                    "  GET  /openapi.json          every request body's schema")
    serve_options.add_arguments(serve)
    serve.set_defaults(handler=_serve)
    return parser


def _serve(args) -> int:
    try:
        from radixcache.integrations.serve.server import main as serve_main
    except ModuleNotFoundError as exc:
        print(f"radixcache serve needs {exc.name}: pip install '.[serve]' in a clone of radixcache "
              f"(or pip install {exc.name})", file=sys.stderr)
        return 1
    return serve_main(args)


def _kv_size(args, parser) -> int:
    shapes = []
    try:
        shapes += [kv_size.from_model_dir(path) for path in args.model or ()]
        shapes += [kv_size.preset(name) for name in args.preset or ()]
    except ValueError as exc:
        parser.error(str(exc))
    if not shapes:
        shapes = list(kv_size.PRESETS.values())
    dtypes = args.dtype or DEFAULT_DTYPES
    rows = kv_size_table.kv_size_table(shapes, args.context, args.sequences, dtypes, memory=args.memory)
    largest = max(rows, key=lambda row: row["bytes_total"])
    if largest["bytes_total"] > MAX_BYTES:
        parser.error(f"{args.sequences:,} sequence(s) of {args.context:,} tokens of {largest['name']} "
                     f"({largest['dtype']}) need more than {kv_size_table.format_bytes(MAX_BYTES)} of KV "
                     "cache, more memory than any machine has; lower --context or --sequences")
    fits = f"; sequences that fit in {kv_size_table.format_bytes(args.memory)}" if args.memory else ""
    print(f"KV cache at {args.context:,} tokens per sequence, {args.sequences:,} sequence(s){fits}; "
          f"binary units")
    print(kv_size_table.render_kv_table(rows))
    dtype = (args.dtype or DEFAULT_DTYPES)[0]
    notes = [note for note in (kv_size_table.window_note(shape, args.context, dtypes) for shape in shapes) if note]
    for shape in shapes:
        if shape.attention == "MLA":
            latent = shape.latent_bytes_per_token(dtype)
            notes.append(f"{shape.name} (MLA): head dim is K/V per head as transformers expands them "
                         f"and radixcache's pool holds them; an MLA-native server caches the "
                         f"{shape.latent_dim}+{shape.rope_dim} latent instead: "
                         f"{kv_size_table.format_bytes(latent)} per token in {dtype} "
                         f"({shape.bytes_per_token(dtype) / latent:.1f}x less)")
    if notes:
        print()
    for note in notes:
        print(f"note: {note}")
    return 0


def _demo(args) -> int:
    try:
        from radixcache.app.demo import main as demo_main
    except ModuleNotFoundError as exc:
        if exc.name != "radixcache.app.demo":
            raise
        print("radixcache: the demo is not available in this version", file=sys.stderr)
        return 1
    demo_args = argparse.Namespace(model=args.model, turns=args.turns, out=args.out, dtype=args.dtype,
                                   threads=args.threads, quantize=args.quantize, compile=args.compile)
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
