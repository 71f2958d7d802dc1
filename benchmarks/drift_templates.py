"""Chat templates that drift: what they write for past assistant turns differs from what the model
saw when it produced them (the server tests and ``benchmarks/serve.py`` use them; nothing downloaded).

- ``DRIFT_GENERATION_THINK``: ChatML that puts an empty ``<think></think>`` into the generation
  prompt only (past assistant turns are written without it), as Qwen3-style templates do;
- ``DRIFT_STRIP_THINK``: ChatML that strips ``<think>...</think>`` from past assistant turns.
"""

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

TEMPLATES = {"generation_think": DRIFT_GENERATION_THINK, "strip_think": DRIFT_STRIP_THINK}
