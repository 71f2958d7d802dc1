"""The server over real HTTP: uvicorn on a free loopback port, the ``openai`` client and httpx.

These are the endpoints and answers that need no generation: ``/health``, ``/v1/models``,
``/metrics``, authentication, and every error (400 with OpenAI's error JSON, never 422; 401; 404;
405; 503 while no engine is attached). Generation tests come with the engine wiring.
"""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from radixcache.integrations.serve.app import create_app
from radixcache.integrations.serve.options import ServeOptions
from radixcache.integrations.serve.server import build_state
from serve_helpers import LiveServer, free_socket, write_model_dir

KEY = "sk-test-key"
CONTEXT, POOL = 512, 320
MESSAGES = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_model_dir(tmp_path_factory.mktemp("model") / "tiny-smol", max_positions=CONTEXT)
    options = ServeOptions(model=model_dir, max_cache_tokens=POOL, api_keys=(KEY,),
                           served_model_names=("tiny-smol", "alias"))
    live = LiveServer(create_app(build_state(options)))
    yield live
    live.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=30) as c:
        yield c


def post(server, path, body=None, content=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, content=content, headers=headers, timeout=30)


def assert_error(response, status, param=None, code=None, words=""):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["code"] == code
    assert words in body["error"]["message"]
    return body["error"]


def long_messages(tokens):
    return [{"role": "user", "content": " ".join(["word"] * tokens)}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-smol", "alias"]
    health = httpx.get(server.base_url + "/health", timeout=30)
    assert_error(health, 503, code="unavailable", words="no generation engine")


def test_api_key_is_required(server):
    for key in ("wrong-key", KEY + "x", KEY[:-1]):
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError) as info:
                c.models.list()
            assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                c.chat.completions.create(model="tiny-smol", messages=MESSAGES)
    response = httpx.get(server.base_url + "/v1/models", timeout=30)  # no key at all
    assert_error(response, 401, code="invalid_api_key")
    assert_error(post(server, "/v1/chat/completions", {"messages": MESSAGES}, key=None), 401, code="invalid_api_key")
    # the key is checked before the body: a bad body without the key is still a 401
    assert_error(post(server, "/v1/chat/completions", content=b"{", key="nope"), 401, code="invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.base_url + "/metrics", timeout=30).status_code == 200  # scrapers need no key


@pytest.mark.parametrize("kwargs,param,words", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0", "robot"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"messages": MESSAGES, "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"messages": MESSAGES, "n": 0}, "n", "greater than or equal to 1"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0", "content or tool_calls"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, None, "only allowed when stream"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": long_messages(600)}, "messages", "maximum context length is 512"),
    ({"messages": long_messages(400)}, "messages", "pool holds only 320"),
    ({"messages": MESSAGES, "max_tokens": 600}, "max_tokens", "plus max_tokens (600) exceeds"),
])
def test_bad_chat_requests_get_400_through_the_client(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-smol", **kwargs)
    err = info.value
    assert err.status_code == 400 and err.param == param and words in err.body["message"]
    assert err.body["type"] == "invalid_request_error"


def test_malformed_and_missing_bodies_get_400_not_422(server):
    assert_error(post(server, "/v1/chat/completions", content=b'{"messages": [}'), 400, words="not valid JSON")
    assert_error(post(server, "/v1/chat/completions", content=b"\xff\xfe"), 400, words="not valid JSON")
    assert_error(post(server, "/v1/chat/completions", content=b""), 400, words="not valid JSON")
    assert_error(post(server, "/v1/chat/completions", body=[1, 2]), 400, words="JSON object")
    assert_error(post(server, "/v1/chat/completions", body={"model": "tiny-smol"}), 400, "messages", words="required")
    assert_error(post(server, "/v1/chat/completions", body={"messages": MESSAGES, "max_tokens": "3"}), 400,
                 "max_tokens", words="integer")
    tool_without_id = {"messages": [{"role": "tool", "content": "x"}]}
    assert_error(post(server, "/v1/chat/completions", body=tool_without_id), 400, "messages.0.tool_call_id")


def test_completions_errors(server, client):
    for prompt, words in [([1] * 600, "maximum context length"), ([1] * 400, "pool holds only"),
                          (["a", "b"], "one prompt"), ("", "empty")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny-smol", prompt=prompt)
        assert words in info.value.body["message"]
    # the prompt's ids meet the vocabulary in the engine's one validation pass: no engine, no check
    assert post(server, "/v1/completions", body={"prompt": [5, 10 ** 6]}).status_code == 503
    assert_error(post(server, "/v1/completions", body={"prompt": "x", "echo": True}), 400, words="echo")
    assert_error(post(server, "/v1/completions", content=b"nope"), 400, words="not valid JSON")


def test_unknown_model_route_and_method(server, client):
    for call in (lambda: client.chat.completions.create(model="gpt-4o", messages=MESSAGES),
                 lambda: client.completions.create(model="gpt-4o", prompt="x")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.code == "model_not_found" and info.value.param == "model"
    assert_error(httpx.get(server.base_url + "/v1/nothing", timeout=30), 404, code="not_found")
    assert_error(httpx.get(server.base_url + "/v1/chat/completions", timeout=30), 405, code="method_not_allowed")


def test_valid_requests_pass_every_check_and_meet_no_engine(client):
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="alias", messages=MESSAGES, max_tokens=4, stream=stream,
                                           tools=[{"type": "function", "function": {"name": "f"}}])
        assert info.value.status_code == 503 and info.value.code == "unavailable"
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="tiny-smol", prompt=[1, 2, 3], max_tokens=4)


def test_concurrent_bad_requests_leave_the_server_answering(server):
    bodies = [{"messages": [{"role": "robot", "content": "x"}]}, {"messages": MESSAGES, "max_tokens": -5},
              {"model": "nope", "messages": MESSAGES}, {"messages": long_messages(600)}]
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: post(server, "/v1/chat/completions", bodies[i % 4]).status_code,
                                 range(32)))
    assert sorted(set(statuses)) == [400, 404]
    assert httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=30).status_code == 200


def test_metrics_count_rejections(server):
    post(server, "/v1/chat/completions", body={"messages": []})
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'radixcache:requests_rejected_total{status="400"}' in text
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket"):
        assert "radixcache:" + name in text


def load_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "openai_agent.py"
    spec = importlib.util.spec_from_file_location("openai_agent_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_openai_agent_example_tools_and_its_answer_without_an_engine(server, capsys):
    agent = load_example()
    assert agent.call_tool("calculator", '{"expression": "17 * 23"}') == "391"
    assert agent.call_tool("get_weather", '{"city": "Berlin"}').startswith("rain")
    assert agent.call_tool("calculator", '{"expression": "__import__(1)"}').startswith("error")
    assert agent.call_tool("nope", "{}").startswith("error") and agent.call_tool("calculator", "{").startswith("error")
    assert agent.main(["--base-url", server.base_url + "/v1", "--api-key", KEY]) == 1
    assert "answered 503" in capsys.readouterr().err
    with free_socket() as sock:  # nobody listens there once it is closed
        closed = sock.getsockname()[1]
    assert agent.main(["--base-url", f"http://127.0.0.1:{closed}/v1"]) == 1
    assert "no server at" in capsys.readouterr().err
