"""The real server (``create_app`` over a ``LocalEngine``) on a tiny ``ScriptedLlama`` whose replies
follow a script: for a client that runs in the sandbox (Codex), whose prompts a test cannot
render in advance.

``python tests/scripted_serve.py --model DIR --port N --log FILE --rule KEY REPLY [--rule ...]``:
when a request's prompt is built, the text of its last message (after the last ``<|im_start|>``)
picks the first rule whose KEY it contains, and the model is told to answer that REPLY (then end of
turn), greedy, whatever its sampling settings; a prompt no rule matches is answered by the model's
own random logits. ``--log`` is ``--log-token-ids``. Everything else is the server as it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import uvicorn  # noqa: E402

import radixcache  # noqa: E402
from radixcache.integrations.serve.protocols.openai import (completions as openai_completions,
                                                            responses as openai_responses)
from radixcache.integrations.serve.requests import job  # noqa: E402
from radixcache.integrations.serve.app import create_app  # noqa: E402
from radixcache.integrations.serve.engine.local import LocalEngine  # noqa: E402
from radixcache.integrations.serve.options import ServeOptions  # noqa: E402
from radixcache.integrations.serve.server import build_state  # noqa: E402
from serve_helpers import scripted_llama_class  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--served-model-name", default="smollm2")
    parser.add_argument("--rule", nargs=2, action="append", default=[], metavar=("KEY", "REPLY"))
    args = parser.parse_args()
    model = scripted_llama_class().from_pretrained(args.model).eval()
    model.script = {}
    lm = radixcache.wrap(model, block_size=16, max_cache_tokens=32768)
    options = ServeOptions(model=Path(args.model), served_model_names=(args.served_model_name,),
                           log_token_ids=Path(args.log), port=args.port)
    state = build_state(options)
    state.attach_engine(LocalEngine(lm, lm.new_engine(max_running=options.max_running)))
    tokenizer, new_job = state.tokenizer, job.new_job

    def scripted_job(state_, protocol, name, prompt_ids, **kwargs):
        text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        last = text.rsplit("<|im_start|>", 2)[-2] if text.count("<|im_start|>") >= 2 else text
        for key, reply in args.rule:
            if key in last:
                ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [2]
                model.script = {len(prompt_ids) - 1 + i: t for i, t in enumerate(ids)}
                kwargs["temperature"] = 0
                break
        else:
            model.script = {}
        return new_job(state_, protocol, name, prompt_ids, **kwargs)

    openai_responses.new_job = openai_completions.new_job = scripted_job
    uvicorn.run(create_app(state), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
