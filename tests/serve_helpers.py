"""Shared pieces of the server tests: the embedded tokenizer, chat templates, a live uvicorn server.

Templates (nothing downloaded): the two drifting ones, ``DRIFT_GENERATION_THINK`` and
``DRIFT_STRIP_THINK``, live in ``benchmarks/drift_templates.py`` (the serve benchmark runs them too)
and are re-exported here;
- ``TOOLS_TEMPLATE``: ChatML with its own tools support (reads ``tools`` and ``tool_calls``, writes
  calls as ``<tool_call>`` blocks with the arguments through ``tojson``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
from drift_templates import DRIFT_GENERATION_THINK, DRIFT_STRIP_THINK  # noqa: E402

__all__ = ["DRIFT_GENERATION_THINK", "DRIFT_STRIP_THINK", "LiveServer", "ServeProcess", "Served", "TOOLS_TEMPLATE",
           "embedded_tokenizer", "free_socket", "metric", "tokenizer_with_template", "write_model_dir"]

TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if message['content'] %}{{ message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] is defined %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if not loop.first or message['content'] %}{{ '\n' }}{%- endif %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- call['function']['arguments'] | tojson }}{{ '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{ '<|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")


@lru_cache(maxsize=1)
def embedded_tokenizer():
    """The embedded SmolLM2's tokenizer (converted once into the shared cache dir, then read)."""
    from transformers import AutoTokenizer

    from radixcache.models import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)


def tokenizer_with_template(template: str | None):
    """A copy of the embedded tokenizer whose own chat template is ``template``."""
    import copy

    tokenizer = copy.deepcopy(embedded_tokenizer())
    tokenizer.chat_template = template
    return tokenizer


def write_model_dir(path, max_positions: int = 512, chat_template: str | None = None, weights: bool = False):
    """A model directory the server can read (tokenizer, config, generation config); with
    ``weights``, also a tiny random Llama (seed 0) saved with ``save_pretrained``."""
    import torch
    import transformers as tf

    tokenizer = tokenizer_with_template(chat_template) if chat_template else embedded_tokenizer()
    tokenizer.save_pretrained(path)
    config = tf.LlamaConfig(vocab_size=len(embedded_tokenizer()), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2)
    config.save_pretrained(path)
    tf.GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(path)
    if weights:
        torch.manual_seed(0)
        tf.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def free_socket() -> socket.socket:
    """A socket bound to a free loopback port (the server listens on it; no race for the port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class LiveServer:
    """A real uvicorn serving ``app`` on a free 127.0.0.1 port, in a thread; ``stop()`` ends it."""

    def __init__(self, app, startup_s: float = 30.0):
        import uvicorn

        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.loop = None  # the server's event loop, once it runs
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="uvicorn-test", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the test server did not stop"


class ServeProcess:
    """The real ``radixcache serve`` command as a subprocess on a free loopback port (offline), started
    and ready (``GET /health`` 200) when constructed; ``base_url`` is its root and ``output`` what it
    printed so far (read as it comes). ``wait(timeout)`` waits for its exit code; ``stop()`` kills it
    if it still runs and returns its whole output."""

    def __init__(self, model_dir, *args: str, startup_s: float = 120.0, env: dict | None = None):
        import httpx

        with free_socket() as sock:
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "radixcache.app.cli", "serve", "--model", str(model_dir),
                                      "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self._lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"radixcache serve exited: {self.stop()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"radixcache serve did not start: {self.stop()}")
            time.sleep(0.3)

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             **kwargs)

    def wait_for_output(self, text: str, timeout: float = 30.0) -> None:
        """Wait until the process has printed ``text``."""
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output
            time.sleep(0.02)

    def wait(self, timeout: float) -> int:
        """The exit code, once it exited (``subprocess.TimeoutExpired`` after ``timeout`` s)."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=10)
        return self.output


def scripted_llama_class():
    """``ScriptedLlama``: a ``LlamaForCausalLM`` that can be told what to say (built lazily, so
    importing these helpers imports no transformers)."""
    import transformers as tf

    class ScriptedLlama(tf.LlamaForCausalLM):
        """A tiny random Llama whose ``script`` (position -> token id) forces the token predicted
        after those positions (a large bias on that logit), so a test can make it emit a tool call
        or a reasoning block; at every other position its own random logits decide. The K/V it
        computes are the model's own either way, so the cache is tested as with any model."""

        script: dict = {}

        def forward(self, input_ids=None, position_ids=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids=input_ids, position_ids=position_ids,
                                  logits_to_keep=logits_to_keep, **kwargs)
            if self.script and position_ids is not None:
                positions = position_ids[0]
                if isinstance(logits_to_keep, int):
                    positions = positions[-logits_to_keep:] if logits_to_keep else positions
                else:
                    positions = positions[logits_to_keep]
                for row, position in enumerate(positions.tolist()):
                    token = self.script.get(position)
                    if token is not None:
                        out.logits[0, row, token] += 1e4
            return out

    return ScriptedLlama


class Served:
    """A live server over a real engine: ``ScriptedLlama`` weights from ``model_dir`` wrapped by
    radixcache, the ``LocalEngine`` on it, the app under uvicorn on a free loopback port.

    ``options`` are ``ServeOptions`` fields; ``lm_options`` go to ``radixcache.wrap``;
    ``engine_options`` to ``LocalEngine``; ``model_class`` replaces ``ScriptedLlama`` (a subclass). ``quiet()`` waits until the engine holds nothing (the
    history precomputes included); ``assert_clean()`` then checks that no block or lock leaked.
    """

    def __init__(self, model_dir, lm_options=None, engine_options=None, model_class=None, **options):
        import radixcache
        from radixcache.integrations.serve.app import create_app
        from radixcache.integrations.serve.engine.local import LocalEngine
        from radixcache.integrations.serve.options import ServeOptions
        from radixcache.integrations.serve.server import build_state

        self.model = (model_class or scripted_llama_class()).from_pretrained(model_dir).eval()
        self.model.script = {}
        self.lm = radixcache.wrap(self.model, **{"block_size": 16, "max_cache_tokens": 8192,
                                                 **(lm_options or {})})
        self.options = ServeOptions(model=model_dir, **options)
        self.state = build_state(self.options)
        self.engine = LocalEngine(self.lm, self.lm.new_engine(max_running=self.options.max_running),
                                  **(engine_options or {}))
        self.state.attach_engine(self.engine)
        self.live = LiveServer(create_app(self.state))
        self.base_url = self.live.base_url

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=kwargs.pop("api_key", "none"),
                             max_retries=0, timeout=kwargs.pop("timeout", 120), **kwargs)

    def anthropic(self, **kwargs):
        """An ``anthropic.Anthropic`` client of this server (no retries; ``api_key`` "none" unless
        given, or an ``auth_token`` is)."""
        import anthropic

        if "auth_token" not in kwargs:
            kwargs.setdefault("api_key", "none")
        return anthropic.Anthropic(base_url=self.base_url, max_retries=0, timeout=kwargs.pop("timeout", 120), **kwargs)

    def render(self, messages, tools=None) -> tuple:
        """The prompt ids the server makes of ``messages`` (its own renderer)."""
        return self.state.renderer.render(messages, tools).token_ids

    def say(self, messages, text: str, tools=None, eos: bool = True) -> None:
        """Make the next reply to ``messages`` be ``text`` (then EOS), greedy."""
        prompt = self.render(messages, tools)
        ids = list(self.state.tokenizer(text, add_special_tokens=False)["input_ids"]) + ([2] if eos else [])
        self.model.script = {len(prompt) - 1 + i: t for i, t in enumerate(ids)}

    def plain_greedy_text(self, prompt, max_new: int) -> str:
        """The text of ``model.generate`` (plain transformers, greedy, the server's stop ids) on
        ``prompt``, decoded as the server decodes a reply."""
        import torch

        stops = self.state.info.stop_token_ids
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                      do_sample=False, eos_token_id=sorted(stops), pad_token_id=0)
        generated = [t for t in out[0, len(prompt):].tolist() if t not in stops]
        return self.state.tokenizer.decode(generated, skip_special_tokens=True)

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.base_url + "/metrics", timeout=30).text

    def quiet(self, timeout_s: float = 60.0) -> None:
        """Wait until the server and the engine hold nothing: no response still being written (its
        admission slot), no history work still rendering or submitting, no open request, no work,
        no live lease. A history precompute is submitted from a background task that a reply
        starts after its last chunk went out, so the client can have its answer before it exists."""
        deadline = time.monotonic() + timeout_s
        while (self.state.gate.in_flight or len(self.state.pending_histories) or self.engine.open_requests
               or self.engine.engine.has_work or self.lm.stats()["running"]):
            assert time.monotonic() < deadline, "the engine did not become idle"
            time.sleep(0.01)

    def assert_clean(self) -> None:
        self.quiet()
        assert self.lm.cache.leaks() == [] and self.lm.cache.pinned_blocks == 0
        self.lm.manager.check()
        assert self.lm.stats()["running"] == 0

    def stop(self) -> None:
        self.live.stop()
        self.assert_clean()


def keyed_served(tmp_path_factory, *keys: str) -> Served:
    """A ``Served`` of a tiny model (2,048 positions) that requires one of ``keys``."""
    directory = tmp_path_factory.mktemp("keyed") / "tiny-smol"
    write_model_dir(directory, max_positions=2048, weights=True)
    return Served(directory, api_keys=keys)


def metric(text: str, name: str, **labels) -> float:
    """The value of sample ``radixcache:NAME{labels}`` in a Prometheus text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "radixcache:" + name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
