"""Shared pieces of the server tests: the embedded tokenizer, chat templates, a live uvicorn server.

Templates (written here, nothing downloaded):
- ``DRIFT_GENERATION_THINK``: ChatML that puts an empty ``<think></think>`` into the generation
  prompt only (past assistant turns are written without it), as Qwen3-style templates do;
- ``DRIFT_STRIP_THINK``: ChatML that strips ``<think>...</think>`` from past assistant turns;
- ``TOOLS_TEMPLATE``: ChatML with its own tools support (reads ``tools`` and ``tool_calls``, writes
  calls as ``<tool_call>`` blocks with the arguments through ``tojson``).
"""

from __future__ import annotations

import socket
import threading
import time
from functools import lru_cache

DRIFT_GENERATION_THINK = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{%- endif %}")

DRIFT_STRIP_THINK = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")

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


def write_model_dir(path, max_positions: int = 512, chat_template: str | None = None):
    """A model directory the server can read (tokenizer, config, generation config; no weights)."""
    import transformers as tf

    tokenizer = tokenizer_with_template(chat_template) if chat_template else embedded_tokenizer()
    tokenizer.save_pretrained(path)
    config = tf.LlamaConfig(vocab_size=len(embedded_tokenizer()), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2)
    config.save_pretrained(path)
    tf.GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(path)
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
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn-test", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the test server did not stop"
