"""``radixcache serve`` options: the argparse arguments and the validated ``ServeOptions``.

``add_arguments(parser)`` adds every option to an argparse parser (the ``serve`` subcommand of
``radixcache``); ``ServeOptions.from_args(args)`` checks them (files exist, numbers in range) and
raises ``ValueError`` naming the option otherwise.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from radixcache.args import positive_int
from radixcache.models import DTYPE_CHOICES

DEFAULT_PORT = 8000
DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_QUEUE = 256
API_KEY_ENV = "RADIXCACHE_API_KEY"
# input bounds: a body may hold about 32 bytes per context token (JSON, tools and repeated turns
# included), and never less than 4 MiB
MIN_REQUEST_BYTES = 4 << 20
REQUEST_BYTES_PER_CONTEXT_TOKEN = 32
DEFAULT_MAX_MESSAGES = 4096
DEFAULT_MAX_TOOLS = 512
DEFAULT_MAX_STOP = 64


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server's options to ``parser``."""
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="local Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="the weights' and the KV cache's dtype (default auto: bfloat16 on CUDA and on CPUs "
                             "with native bf16 matrix units, AMX / AVX512-BF16 / Arm BF16; float32 elsewhere)")
    parser.add_argument("--threads", type=positive_int, metavar="N", default=None,
                        help="threads of the model's CPU kernels (default: OMP_NUM_THREADS when set, else the "
                             "CPUs this process may use, its affinity and cgroup quota)")
    parser.add_argument("--compile", action="store_true",
                        help="run the engine's steps through torch.compile, compiled at start-up (minutes on a "
                             "CPU; faster decode after); falls back to eager, saying why, where it cannot")
    parser.add_argument("--quantize", choices=("int8",), default=None,
                        help="weight-only int8 (torchao, radixcache's [quantize] extra): fewer bytes per token, "
                             "changed tokens (the greedy agreement on a probe is logged); on a CPU it pays with "
                             "--compile only")
    # radixcache.attention.select.NAMES (not imported: it would load torch for --help)
    parser.add_argument("--attention", choices=("auto", "torch", "torch-inplace", "flashinfer"), default="auto",
                        help="the attention backend; torch: gather + SDPA, the reference; torch-inplace: on CPU, "
                             "decodes read the KV pages where they lie (faster; tokens may part from plain "
                             "generate's in the last bits); default auto: FlashInfer on CUDA where installed, "
                             "torch-inplace on CPU in bfloat16/float16, torch in float32")
    parser.add_argument("--max-cache-tokens", type=positive_int, metavar="N", default=None,
                        help="KV pool size in tokens (default: 25%% of free RAM on CPU, 50%% of free GPU memory)")
    parser.add_argument("--block-size", type=positive_int, metavar="N", default=16,
                        help="tokens per KV block (default 16)")
    parser.add_argument("--chat-template", metavar="FILE", default=None,
                        help="a Jinja chat template file that replaces the tokenizer's")
    parser.add_argument("--served-model-name", metavar="NAME", nargs="+", default=None,
                        help="the model name(s) clients send (default: the model directory's name)")
    parser.add_argument("--api-key", metavar="KEY", action="append", default=None,
                        help=f"require 'Authorization: Bearer KEY'; repeatable, one key per tenant "
                             f"(also read from ${API_KEY_ENV})")
    parser.add_argument("--share-cache-across-keys", action="store_true",
                        help="share cached prefixes, stored responses and history between API keys (off by "
                             "default: each key is its own tenant). Any tenant then learns, from its cached "
                             "tokens and its time to first token, which prefixes the others sent")
    parser.add_argument("--isolate-cache-by-key", action="store_true", help=argparse.SUPPRESS)  # the default now
    parser.add_argument("--max-running", type=positive_int, metavar="N", default=DEFAULT_MAX_RUNNING,
                        help=f"requests in the running batch at most (default {DEFAULT_MAX_RUNNING})")
    parser.add_argument("--max-queue", type=positive_int, metavar="N", default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting beyond those, before 429 (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--store", metavar="URL", default=None,
                        help="a shared KV tier: redis://[user:password@]host:port/db (or rediss://, unix://); "
                             "replicas on one store share their prefixes")
    parser.add_argument("--store-secret-file", metavar="FILE", default=None,
                        help="a file holding the secret the replicas of --store share: every stored block then "
                             "carries a MAC and a block without a valid one is a miss (default: the "
                             "RADIXCACHE_STORE_SECRET environment variable; without either the store trusts "
                             "whoever can write to its Redis)")
    parser.add_argument("--kv-events", metavar="ENDPOINT", default=None,
                        help="publish the cache's blocks as vLLM KV events on a ZMQ PUB socket bound at "
                             "ENDPOINT, e.g. tcp://127.0.0.1:5557 (for KV-aware routers)")
    parser.add_argument("--kv-events-allow-remote", action="store_true",
                        help="let --kv-events bind an address that is not loopback (its events carry every "
                             "block's token ids: whoever connects reads every tenant's prompts)")
    parser.add_argument("--kv-events-topic", metavar="TOPIC", default="kv",
                        help="the topic frame of every KV event message (default kv)")
    parser.add_argument("--max-request-bytes", type=positive_int, metavar="N", default=None,
                        help=f"refuse (413) a request body over N bytes before reading it (default: "
                             f"{REQUEST_BYTES_PER_CONTEXT_TOKEN} bytes per token of the model's context, at least "
                             f"{MIN_REQUEST_BYTES >> 20} MiB)")
    parser.add_argument("--max-messages", type=positive_int, metavar="N", default=DEFAULT_MAX_MESSAGES,
                        help=f"refuse (413) a request with more messages or input items (default {DEFAULT_MAX_MESSAGES})")
    parser.add_argument("--max-tools", type=positive_int, metavar="N", default=DEFAULT_MAX_TOOLS,
                        help=f"refuse (413) a request with more tools (default {DEFAULT_MAX_TOOLS})")
    parser.add_argument("--max-stop", type=positive_int, metavar="N", default=DEFAULT_MAX_STOP,
                        help=f"refuse (413) a request with more stop strings (default {DEFAULT_MAX_STOP}; OpenAI's "
                             "own protocols allow 4)")
    parser.add_argument("--metrics-require-key", action="store_true",
                        help="/metrics answers only with an API key (default: open, as vLLM's, for scrapers)")
    parser.add_argument("--max-output-tokens", type=positive_int, metavar="N", default=None,
                        help="cap on the tokens one request generates, on every protocol (default: what "
                             "the context leaves after the prompt)")
    parser.add_argument("--log-token-ids", metavar="FILE", default=None,
                        help="append one JSON line per request to FILE: its protocol, prompt token ids, "
                             "cached tokens and output token ids")
    parser.add_argument("--no-history-precompute", action="store_true",
                        help="do not compute each reply's history form into the cache after it finishes")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log level (default info)")


@dataclass(frozen=True)
class ServeOptions:
    """The server's validated settings (see ``add_arguments`` for each)."""

    model: Path | None = None
    dtype: str = "auto"
    threads: int | None = None  # None: radixcache.compute_threads.default_threads()
    compile: bool = False  # the engine's steps through torch.compile
    quantize: str | None = None  # "int8": weight-only, radixcache.quantize
    attention: str = "auto"  # radixcache.attention.resolve_backend's name
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_cache_tokens: int | None = None
    block_size: int = 16
    chat_template: str | None = None  # the template's text, read from --chat-template
    served_model_names: tuple = ()
    api_keys: tuple = ()
    share_cache_across_keys: bool = False
    max_running: int = DEFAULT_MAX_RUNNING
    max_queue: int = DEFAULT_MAX_QUEUE
    history_precompute: bool = True
    store: str | None = None  # the --store URL
    store_secret_file: Path | None = None
    kv_events: str | None = None  # the --kv-events endpoint
    kv_events_topic: str = "kv"
    log_level: str = "info"
    max_output_tokens: int | None = None
    log_token_ids: Path | None = None  # the --log-token-ids file
    max_request_bytes: int | None = None  # None: from the model's context (``request_bytes``)
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_tools: int = DEFAULT_MAX_TOOLS
    max_stop: int = DEFAULT_MAX_STOP
    metrics_require_key: bool = False
    kv_events_allow_remote: bool = False

    def request_bytes(self, context_tokens: int) -> int:
        """The body bound: ``--max-request-bytes``, else from the model's context."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_CONTEXT_TOKEN * context_tokens)

    @property
    def max_in_flight(self) -> int:
        """Requests running plus waiting; one more gets 429."""
        return self.max_running + self.max_queue

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        """Validated options from parsed arguments; raises ``ValueError`` naming the bad option."""
        model = None
        if args.model is not None:
            model = Path(args.model).expanduser()
            if not (model / "config.json").is_file():
                raise ValueError(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
        template = None
        if args.chat_template is not None:
            path = Path(args.chat_template).expanduser()
            try:
                template = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"--chat-template {args.chat_template}: {exc.strerror or exc}") from None
            if not template.strip():
                raise ValueError(f"--chat-template {args.chat_template}: the file is empty")
        keys = list(args.api_key or [])
        if not keys and os.environ.get(API_KEY_ENV):
            keys = [os.environ[API_KEY_ENV]]
        if any(not k.strip() for k in keys):
            raise ValueError("--api-key: a key must not be empty")
        if getattr(args, "isolate_cache_by_key", False) and getattr(args, "share_cache_across_keys", False):
            raise ValueError("--isolate-cache-by-key and --share-cache-across-keys contradict each other "
                             "(isolation is the default: drop --isolate-cache-by-key)")
        if getattr(args, "share_cache_across_keys", False) and not keys:
            raise ValueError("--share-cache-across-keys needs at least one --api-key")
        if args.max_cache_tokens is not None and args.max_cache_tokens < args.block_size:
            raise ValueError(f"--max-cache-tokens {args.max_cache_tokens} is smaller than one block "
                             f"(--block-size {args.block_size})")
        store = getattr(args, "store", None)
        if store is not None and not store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--store {store}: expected a redis://, rediss:// or unix:// URL")
        secret_file = getattr(args, "store_secret_file", None)
        if secret_file is not None:
            if store is None:
                raise ValueError("--store-secret-file needs --store")
            secret_file = Path(secret_file).expanduser()
            if not secret_file.is_file():
                raise ValueError(f"--store-secret-file {secret_file}: no such file")
        kv_events = getattr(args, "kv_events", None)
        if kv_events is not None and "://" not in kv_events:
            raise ValueError(f"--kv-events {kv_events}: expected a ZMQ endpoint such as tcp://127.0.0.1:5557")
        remote = getattr(args, "kv_events_allow_remote", False)
        if kv_events is not None and not remote:
            from radixcache.kv_events.publisher import is_local_endpoint

            if not is_local_endpoint(kv_events):
                raise ValueError(f"--kv-events {kv_events}: not a loopback address; KV events carry every "
                                 "block's token ids (every tenant's prompts): add --kv-events-allow-remote to "
                                 "bind it anyway")
        if getattr(args, "metrics_require_key", False) and not keys:
            raise ValueError("--metrics-require-key needs at least one --api-key")
        topic = getattr(args, "kv_events_topic", "kv")
        log_file = getattr(args, "log_token_ids", None)
        if log_file is not None:
            log_file = Path(log_file).expanduser()
            if not log_file.parent.is_dir():
                raise ValueError(f"--log-token-ids {log_file}: no such directory {log_file.parent}")
        return cls(model=model, dtype=getattr(args, "dtype", "auto"), threads=getattr(args, "threads", None),
                   compile=getattr(args, "compile", False), quantize=getattr(args, "quantize", None),
                   attention=getattr(args, "attention", "auto"),
                   host=args.host, port=args.port, max_cache_tokens=args.max_cache_tokens,
                   block_size=args.block_size, chat_template=template,
                   served_model_names=tuple(args.served_model_name or ()), api_keys=tuple(keys),
                   share_cache_across_keys=getattr(args, "share_cache_across_keys", False),
                   max_running=args.max_running,
                   max_queue=args.max_queue, history_precompute=not args.no_history_precompute,
                   store=store, store_secret_file=secret_file, kv_events=kv_events, kv_events_topic=topic, log_level=args.log_level,
                   max_output_tokens=getattr(args, "max_output_tokens", None),
                   max_request_bytes=getattr(args, "max_request_bytes", None),
                   max_messages=getattr(args, "max_messages", DEFAULT_MAX_MESSAGES),
                   max_tools=getattr(args, "max_tools", DEFAULT_MAX_TOOLS),
                   max_stop=getattr(args, "max_stop", DEFAULT_MAX_STOP),
                   metrics_require_key=getattr(args, "metrics_require_key", False),
                   kv_events_allow_remote=remote,
                   log_token_ids=log_file)
