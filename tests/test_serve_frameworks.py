"""Agent frameworks as their users write them, against a real server (a tiny random model behind
the embedded tokenizer): LangChain with ``bind_tools``, smolagents' ``ToolCallingAgent`` and the
OpenAI Agents SDK on chat completions. Each runs its own multi-step loop (the loops of
``benchmarks/agent_client_loops.py``); every request after the first must read at least 95 % of the
ideal from the cache (``token_log.ideal_cached`` over the ``--log-token-ids`` lines), and nothing
leaks."""

import sys
from pathlib import Path

import pytest

from radixcache.integrations.serve.telemetry.token_log import ideal_cached, read_token_log
from serve_helpers import Served, write_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import agent_client_loops  # noqa: E402

KEY = "sk-frameworks"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("frameworks") / "tiny-smol"
    write_model_dir(directory, max_positions=4096, weights=True)
    log = tmp_path_factory.mktemp("log") / "tokens.jsonl"
    server = Served(directory, api_keys=(KEY,), max_output_tokens=24, log_token_ids=log,
                    served_model_names=("tiny-smol",))
    yield server, log
    server.stop()


@pytest.mark.parametrize("client", ["langchain", "smolagents", "agents-sdk-chat"])
def test_each_later_request_reads_the_ideal_from_the_cache(served, client, tmp_path):
    server, log = served
    server.model.script = {}
    before = len(read_token_log(log))
    agent_client_loops.CLIENTS[client](server.base_url, "tiny-smol", KEY, 3, str(tmp_path))
    server.quiet()
    lines = read_token_log(log)[before:]
    assert len(lines) >= 2, f"{client} made {len(lines)} requests"
    for i, (line, ideal) in enumerate(zip(lines, ideal_cached(lines, 16))):
        if i:
            assert line["cached_tokens"] >= 0.95 * ideal, (client, i, line["cached_tokens"], ideal)
    assert sum(ideal_cached(lines, 16)[1:]) > 0, "the loop never resent its conversation"
    server.assert_clean()
