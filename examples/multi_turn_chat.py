"""A multi-turn chat: the whole history is re-sent every turn, and only the new part is computed.

Like most chat apps, this keeps a list of messages, renders it with the tokenizer's chat template
each turn and decodes the reply as text. The rendered history is a prefix of the next turn's prompt,
so ``radixcache.wrap`` serves it from the cache; ``stats()`` reports the hit rate at the end.

Run (uses the embedded SmolLM2-135M-Instruct, CPU is fine):  python examples/multi_turn_chat.py
"""

import time

import radixcache
from radixcache.models import load_model

SYSTEM = ("You are a friendly travel assistant for a trip to Lisbon in May. Keep answers short. "
          "The traveller is vegetarian, walks a lot, likes museums and live music, and has a "
          "budget of about 120 euros a day for food, transport and tickets.")
QUESTIONS = [
    "What should I pack?",
    "Which neighbourhood is good to stay in?",
    "Suggest a vegetarian dinner spot.",
    "How do I get from the airport to the centre?",
    "Plan my first morning in two sentences.",
]


def main():
    model, tokenizer = load_model()
    chat = radixcache.wrap(model)  # 1. wrap once

    history = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        inputs = tokenizer.apply_chat_template(history, add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        hits = chat.stats()["hit_tokens"]
        start = time.perf_counter()
        out = chat.generate(**inputs, max_new_tokens=40, do_sample=False)  # 2. generate
        seconds = time.perf_counter() - start
        prompt_len = inputs["input_ids"].shape[1]
        answer = tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True).strip()
        history.append({"role": "assistant", "content": answer})
        print(f"you: {question}\nbot: {answer}")
        print(f"     [{prompt_len:,} prompt tokens, {chat.stats()['hit_tokens'] - hits:,} cached, "
              f"{seconds:.1f} s]\n")

    stats = chat.stats()  # 3. stats
    print(f"hit rate: {stats['hit_rate']:.1%} ({stats['hit_tokens']:,} of "
          f"{stats['queried_tokens']:,} prompt tokens reused)")


if __name__ == "__main__":
    main()
