"""An agent loop with a fixed tool preamble: each step reuses everything computed before it.

The agent's prompt only ever grows: system prompt + task, then per step the model's tool call and a
tool result are appended as tokens. ``radixcache.wrap`` notices the shared prefix and prefills only
the new tokens; ``stats()`` reports how many prompt tokens came from the cache.

Run (uses the embedded SmolLM2-135M-Instruct, CPU is fine):  python examples/agent_loop.py
"""

import torch

import radixcache
from radixcache.models import load_model

SYSTEM = """You are an agent. Call one tool per message as JSON: {"tool": NAME, "arguments": {...}}.
Tools:
{"name": "search", "description": "Search the web.", "parameters": {"query": "string"}}
{"name": "read_file", "description": "Read a workspace file.", "parameters": {"path": "string"}}
{"name": "run_python", "description": "Run Python code, return stdout.", "parameters": {"code": "string"}}
{"name": "calculator", "description": "Evaluate arithmetic exactly.", "parameters": {"expression": "string"}}
When the tool results answer the task, reply with the final answer in one sentence."""

TASK = "How many lines does data/cities.csv have, and what is the mean population?"
TOOL_RESULTS = [  # what the (scripted) tools return, one per agent step
    '{"path": "data/cities.csv", "content": "name,population\\nOslo,709000\\nBergen,291000\\n"}',
    '{"stdout": "3 lines; mean population 500000.0\\n", "exit_code": 0}',
    '{"expression": "(709000 + 291000) / 2", "result": 500000}',
    '{"results": [{"title": "Norway city populations 2024", "url": "https://example.org/no"}]}',
]


def main():
    model, tokenizer = load_model()
    lm = radixcache.wrap(model)  # 1. wrap once

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids

    for step, result in enumerate(TOOL_RESULTS, 1):
        hits = lm.stats()["hit_tokens"]
        out = lm.generate(ids, max_new_tokens=32, do_sample=False)  # 2. generate, as model.generate
        reply = out[0, ids.shape[1]:]
        cached = lm.stats()["hit_tokens"] - hits
        print(f"step {step}: prompt {ids.shape[1]:,} tokens, {cached:,} from cache")
        print("  agent:", tokenizer.decode(reply, skip_special_tokens=True).strip()[:90])
        # Append at the token level: the reply exactly as generated, then the tool's message
        # (in ChatML, the default model's chat format).
        if reply[-1].item() != tokenizer.eos_token_id:
            reply = torch.cat([reply, torch.tensor([tokenizer.eos_token_id])])
        tool_text = f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
        tool_ids = tokenizer(tool_text, add_special_tokens=False, return_tensors="pt").input_ids
        ids = torch.cat([ids, reply[None], tool_ids], dim=1)

    stats = lm.stats()  # 3. stats
    print(f"hit rate: {stats['hit_rate']:.1%} ({stats['hit_tokens']:,} of "
          f"{stats['queried_tokens']:,} prompt tokens reused)")


if __name__ == "__main__":
    main()
