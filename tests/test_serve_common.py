"""What every protocol shares, over HTTP against a real server: the key by either header, the
``--max-output-tokens`` cap, the ``--log-token-ids`` lines, and a router's rewritten body."""

import httpx
import pytest

from radixcache.integrations.serve.telemetry.token_log import read_token_log
from serve_helpers import Served, write_model_dir

KEY = "sk-common"
MESSAGES = [{"role": "user", "content": "Say something long."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("common") / "tiny-smol"
    write_model_dir(directory, max_positions=512, weights=True)
    log = tmp_path_factory.mktemp("log") / "tokens.jsonl"
    server = Served(directory, api_keys=(KEY,), max_output_tokens=5, log_token_ids=log)
    yield server, log
    server.stop()


def post(server, body, **headers):
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_x_api_key_authenticates_like_the_bearer(served):
    server, _ = served
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    assert post(server, body, **{"x-api-key": KEY}).status_code == 200
    assert post(server, body, Authorization=f"Bearer {KEY}").status_code == 200
    for headers in ({"x-api-key": "wrong"}, {}, {"Authorization": KEY}):
        response = post(server, body, **headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/v1/models", headers={"x-api-key": KEY}, timeout=30).status_code == 200


def test_max_output_tokens_caps_every_request(served):
    server, _ = served
    server.model.script = {}
    with server.client(api_key=KEY) as client:
        for asked in (None, 400, 3):
            extra = {} if asked is None else {"max_tokens": asked}
            body = client.chat.completions.create(model="tiny-smol", messages=MESSAGES, temperature=0,
                                                  stop=None, **extra)
            assert body.usage.completion_tokens <= min(5, asked or 5)
            if body.choices[0].finish_reason == "length":
                assert body.usage.completion_tokens == min(5, asked or 5)
    server.assert_clean()


def test_a_routers_rewritten_body_is_served(served):
    """SMG forwards bodies with ``logprobs: false``, ``stream: false`` and ``tool_choice: "auto"``
    added and ``content: null`` dropped: all of it is served, not refused."""
    server, _ = served
    body = {"model": "tiny-smol", "messages": MESSAGES, "max_tokens": 2, "logprobs": False, "stream": False,
            "tool_choice": "auto", "temperature": 0}
    response = post(server, body, **{"x-api-key": KEY})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_token_log_has_one_exact_line_per_request(served):
    server, log = served
    before = len(read_token_log(log))
    prompt = server.render(MESSAGES)
    server.say(MESSAGES, "Fine.")
    with server.client(api_key=KEY) as client:
        first = client.chat.completions.create(model="tiny-smol", messages=MESSAGES, temperature=0)
        second = client.chat.completions.create(model="tiny-smol", messages=MESSAGES, temperature=0)
    server.quiet()
    lines = read_token_log(log)[before:]
    assert [line["protocol"] for line in lines] == ["chat", "chat"]
    assert [line["id"] for line in lines] == [first.id, second.id]
    for line, body in zip(lines, (first, second)):
        assert tuple(line["prompt_ids"]) == tuple(prompt)
        assert line["cached_tokens"] == body.usage.prompt_tokens_details.cached_tokens
        assert len(line["output_ids"]) == 1 and len(line["output_ids"][0]) == body.usage.completion_tokens
        assert line["finish_reasons"] == ["stop"]
    expected = server.state.tokenizer("Fine.", add_special_tokens=False)["input_ids"] + [2]
    assert lines[0]["output_ids"][0] == expected
    assert lines[1]["cached_tokens"] > 0


def test_ideal_cached_is_the_longest_covered_prefix_in_whole_blocks():
    from radixcache.integrations.serve.telemetry.token_log import ideal_cached

    line = lambda prompt, *outs: {"prompt_ids": list(prompt), "output_ids": [list(o) for o in outs]}
    lines = [line(range(10), [50, 51, 52]),
             line(list(range(10)) + [50, 51, 52, 7, 8]),  # continues turn 1 and its reply: 13 covered
             line(list(range(6)) + [9, 9, 9]),  # shares 6 with both
             line(range(4)),  # wholly covered: capped at the prompt minus one, then whole blocks
             line([])]
    assert ideal_cached(lines, 4) == [0, 12, 4, 3, 0]
    assert ideal_cached(lines, 1) == [0, 13, 6, 3, 0]
