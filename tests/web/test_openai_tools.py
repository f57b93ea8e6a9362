"""Function tools on /v1/chat/completions, on a gpt-oss-layout checkpoint whose harmony chat
template renders them: the official `openai` client offers a tool, gets the model's call back
(whole and streamed), answers it with the tool's result, and the next job is fed the whole
conversation as harmony writes it; `tool_choice` says which tools the prompt declares; bad
shapes, and tools on a model that does not take them, are 400s naming the field.

No weights here can call a function, so the model's reply is scripted: `FakeCoordinator` writes
it into the store as the coordinator writes rounds, after feeding each job's prompt through the
model's real tokenizer and template as the coordinator does.
"""

from __future__ import annotations

import json
import threading

import openai
import pytest
from werkzeug.serving import make_server

from models.jobs import Job
from specpipe.decoding.target import open_target
from tests.harmony_checkpoint import TOOLS_TEMPLATE, write_checkpoint
from tests.web.test_openai_api import (
    FakeCoordinator,
    assert_openai_error,
    events,
    job_count,
    post,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}
ASK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
DECLARED = (
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n// Gets the weather.\ntype get_weather = (_: {\n// The city\n"
    "city: string,\n}) => any;\n\n} // namespace functions<|end|>"
)
THINKING = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
HEADER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
CALLING = [  # the reply as rounds write it: reasoning, then the call, its arguments in pieces
    ([1], "<|channel|>analysis<|message|>Need the"),
    ([1, 2], THINKING),
    ([1, 2, 3], THINKING + HEADER + '{"city":'),
    ([1, 2, 3, 4], THINKING + HEADER + '{"city":"Paris"}<|call|>'),
]
ANSWERING = [
    ([1], "<|channel|>analysis<|message|>It is mild.<|end|><|start|>assistant"),
    (
        [1, 2],
        "<|channel|>analysis<|message|>It is mild.<|end|><|start|>assistant"
        "<|channel|>final<|message|>21 °C in Paris.<|return|>",
    ),
]


@pytest.fixture
def model(tmp_path, monkeypatch) -> str:
    """A gpt-oss-layout checkpoint whose chat template renders tools."""
    return str(write_checkpoint(tmp_path / "oss", monkeypatch, TOOLS_TEMPLATE))


@pytest.fixture
def served(make_app, model, api_token):
    """The web app on the tools model, served over HTTP, and the `openai` client for it."""
    app = make_app(MODEL=model, OPENAI_POLL_S=0.02)
    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{httpd.server_port}/v1",
        api_key=api_token,
        max_retries=0,
        timeout=60,
    )
    yield client
    client.close()
    httpd.shutdown()


def test_a_call_goes_round_to_the_next_request_with_the_official_client(
    served, model, db_url, session
):
    target = open_target(model)
    with FakeCoordinator(db_url, CALLING, pause_s=0.02, codec=target) as coordinator:
        called = served.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], temperature=0
        )
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and len(call.id) > len("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Paris"}')
    # The job was fed the tool's declaration, as the template renders it.
    job = session.get(Job, called.specpipe["job_id"])
    assert job.tools == [WEATHER] and job.messages == ASK
    fed = coordinator.prompts[job.id]
    assert "Calls to these tools must go to the commentary channel: 'functions'." in fed
    assert fed.endswith(
        DECLARED + "<|start|>user<|message|>" + ASK[1]["content"] + "<|end|><|start|>assistant"
    )
    assert called.usage.prompt_tokens == len(target.chat_ids(job.messages, tools=job.tools))

    # The assistant's message as the client got it, then the tool's result.
    history = [
        *ASK,
        choice.message,
        {"role": "tool", "tool_call_id": call.id, "content": '{"c":21}'},
    ]
    with FakeCoordinator(db_url, ANSWERING, pause_s=0.02, codec=target) as coordinator:
        answered = served.chat.completions.create(
            model=model, messages=history, tools=[WEATHER], temperature=0
        )
    assert answered.choices[0].finish_reason == "stop"
    assert answered.choices[0].message.content == "21 °C in Paris."
    assert answered.choices[0].message.tool_calls is None
    job = session.get(Job, answered.specpipe["job_id"])
    fed = coordinator.prompts[job.id]
    assert fed.endswith(
        DECLARED + "<|start|>user<|message|>What is the weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        # The call as harmony renders it (recipient first), whichever header the model wrote.
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"c":21}'
        "<|end|><|start|>assistant"
    )
    assert answered.usage.prompt_tokens == len(target.chat_ids(job.messages, tools=job.tools))
    # The job keeps the conversation readable as its prompt.
    assert job.prompt.endswith(
        'assistant:\n-> get_weather({"city": "Paris"})\n\ntool get_weather: {"c":21}'
    )


def test_a_streamed_call_comes_in_pieces_and_finishes_with_tool_calls(served, model, db_url):
    with FakeCoordinator(db_url, CALLING, pause_s=0.2, codec=open_target(model)):
        chunks = list(
            served.chat.completions.create(
                model=model, messages=ASK, tools=[WEATHER], temperature=0, stream=True
            )
        )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [tool for d in deltas for tool in d.tool_calls or []]
    first, *rest = pieces
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert rest and all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    assert "".join(p.function.arguments for p in pieces) == '{"city":"Paris"}'
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "Need the weather."
    assert not "".join(d.content or "" for d in deltas)  # no marker, no header, no arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize(
    "choice,declared",
    [
        (None, ["get_weather", "now"]),
        ("auto", ["get_weather", "now"]),
        ("none", []),
        ({"type": "function", "function": {"name": "now"}}, ["now"]),
    ],
)
def test_tool_choice_says_which_tools_the_prompt_declares(
    make_app, model, db_url, session, api_token, choice, declared
):
    client = make_app(MODEL=model).test_client()
    body = {"model": model, "messages": ASK, "tools": [WEATHER, NOW], "temperature": 0}
    if choice is not None:
        body["tool_choice"] = choice
    with FakeCoordinator(db_url, CALLING, pause_s=0.02, codec=open_target(model)) as coordinator:
        answer = post(client, "/v1/chat/completions", api_token, body).get_json()
    job = session.get(Job, answer["specpipe"]["job_id"])
    fed = coordinator.prompts[job.id]
    assert [t["function"]["name"] for t in job.tools or []] == declared
    for name in ("get_weather", "now"):
        assert (f"type {name} = " in fed) == (name in declared)
    assert ("# Tools" in fed) == bool(declared)
    message = answer["choices"][0]["message"]
    if declared:  # the reply's call (the script's, whatever was declared) is given apart
        assert answer["choices"][0]["finish_reason"] == "tool_calls"
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    else:  # with none offered, a call is neither an answer nor a call
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert "tool_calls" not in message and message["content"] == ""
    # The JSON API gives the reply's calls too.
    api = client.get(f"/api/v1/jobs/{job.id}", headers={"Authorization": f"Bearer {api_token}"})
    reply = api.get_json()["reply"]
    assert reply["calls"] == [
        {"name": "get_weather", "arguments": '{"city":"Paris"}', "done": True}
    ]


USER = {"role": "user", "content": "hi"}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "noon"}


def fn(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize(
    "change,param",
    [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [fn(name="two words")]}, "tools[0].function.name"),
        ({"tools": [fn(name="x" * 65)]}, "tools[0].function.name"),
        ({"tools": [fn(description=3)]}, "tools[0].function.description"),
        ({"tools": [fn(strict="yes")]}, "tools[0].function.strict"),
        ({"tools": [fn(parameters={"type": "string"})]}, "tools[0].function.parameters"),
        (
            {"tools": [fn(parameters={"type": "object", "properties": {"a": 1}})]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [fn(parameters={"type": "object", "required": "a"})]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, NOW, WEATHER]}, "tools[2].function.name"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}},
            "tool_choice",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"messages": [USER, RESULT]}, "messages[1].tool_call_id"),  # answers no call
        ({"messages": [USER, RESULT, CALLED]}, "messages[1].tool_call_id"),  # before its call
        ({"messages": [USER, {**CALLED, "tool_calls": "now"}]}, "messages[1].tool_calls"),
        (
            {"messages": [USER, {**CALLED, "tool_calls": [{"function": {"name": "now"}}]}]},
            "messages[1].tool_calls[0].id",
        ),
        (
            {"messages": [USER, {**CALLED, "tool_calls": [{"id": "c", "function": {}}]}]},
            "messages[1].tool_calls[0].function",
        ),
        (
            {
                "messages": [
                    USER,
                    {
                        **CALLED,
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [USER, {**CALLED, "tool_calls": [{"id": "c", "type": "code"}]}]},
            "messages[1].tool_calls[0]",
        ),
        (
            {"messages": [USER, {**CALLED, "reasoning_content": ["x"]}]},
            "messages[1].reasoning_content",
        ),
    ],
)
def test_bad_tools_and_tool_messages_are_400s_naming_the_field(
    make_app, model, session, api_token, change, param
):
    client = make_app(MODEL=model).test_client()
    body = {"model": model, "messages": [USER], **change}
    assert_openai_error(post(client, "/v1/chat/completions", api_token, body), 400, param)
    assert job_count(session) == 0


def test_a_completion_takes_no_tools(make_app, model, session, api_token):
    client = make_app(MODEL=model).test_client()
    body = {"model": model, "prompt": "hi", "tools": [WEATHER]}
    assert_openai_error(post(client, "/v1/completions", api_token, body), 400, "tools")
    assert job_count(session) == 0


@pytest.mark.parametrize("kind", ["default", "harmony without tools", "unopened"])
def test_a_model_whose_template_takes_no_tools_refuses_them(
    make_app, session, api_token, tmp_path, monkeypatch, kind
):
    """The default model (SmolLM2's template), a harmony model whose template renders no tools,
    and a model the web app cannot open: tools, and a chat that used them, are 400s."""
    model = {
        "default": "default",
        "harmony without tools": str(write_checkpoint(tmp_path / "oss", monkeypatch)),
        "unopened": "tiny-test",
    }[kind]
    client = make_app(MODEL=model, OPENAI_WAIT_S=0.0).test_client()
    chat = {"model": model, "messages": [USER]}
    error = assert_openai_error(
        post(client, "/v1/chat/completions", api_token, {**chat, "tools": [WEATHER]}), 400, "tools"
    )
    assert "tools are not supported by this model" in error["message"]
    history = {**chat, "messages": [USER, CALLED, RESULT]}
    assert_openai_error(
        post(client, "/v1/chat/completions", api_token, history), 400, "messages[1]"
    )
    assert job_count(session) == 0
    # Saying no tools is no request for them.
    for nothing in ({"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}):
        response = post(client, "/v1/chat/completions", api_token, {**chat, **nothing})
        assert response.status_code == 504, response.get_json()  # taken; nobody runs it here


def test_tool_calls_in_the_stream_match_the_whole_answer(make_app, model, db_url, api_token):
    """The Flask client's view of the same stream: each chunk's JSON as OpenAI writes it."""
    client = make_app(MODEL=model).test_client()
    body = {"model": model, "messages": ASK, "tools": [WEATHER], "temperature": 0}
    with FakeCoordinator(db_url, CALLING, pause_s=0.02):
        whole = post(client, "/v1/chat/completions", api_token, body).get_json()
        chunks = events(post(client, "/v1/chat/completions", api_token, {**body, "stream": True}))
    calls = whole["choices"][0]["message"]["tool_calls"]
    pieces = [
        t
        for c in chunks[:-1]
        if c["choices"]
        for t in c["choices"][0]["delta"].get("tool_calls", [])
    ]
    assert set(pieces[0]) == {"index", "id", "type", "function"}
    assert all(
        set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces[1:]
    )
    streamed = "".join(p["function"]["arguments"] for p in pieces)
    assert streamed == calls[0]["function"]["arguments"] == '{"city":"Paris"}'
    assert pieces[0]["id"] != calls[0]["id"]  # each answer draws its own ids
    assert json.loads(streamed) == {"city": "Paris"}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1] == "[DONE]"


def test_each_choice_gives_its_own_calls_whole_and_streamed(served, model, db_url):
    """With n=2, seeded 7 and 8: the first choice's job calls the function, the second's
    answers in words; each choice comes with its own calls and finish."""

    def by_seed(job: Job) -> list:
        return CALLING if job.seed == 7 else ANSWERING

    request = dict(model=model, messages=ASK, tools=[WEATHER], temperature=0.7, seed=7, n=2)
    with FakeCoordinator(db_url, by_seed, pause_s=0.05, codec=open_target(model), workers=2):
        whole = served.chat.completions.create(**request)
        chunks = list(served.chat.completions.create(**request, stream=True))
    calling, answering = whole.choices
    assert (calling.index, answering.index) == (0, 1)
    assert calling.finish_reason == "tool_calls" and calling.message.content is None
    assert calling.message.tool_calls[0].function.arguments == '{"city":"Paris"}'
    assert answering.finish_reason == "stop" and answering.message.tool_calls is None
    assert answering.message.content == "21 °C in Paris."
    for index, finish in ((0, "tool_calls"), (1, "stop")):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        pieces = [tool for c in mine for tool in c.delta.tool_calls or []]
        assert [c.finish_reason for c in mine][-1] == finish
        if index == 0:
            assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
            assert "".join(p.function.arguments for p in pieces) == '{"city":"Paris"}'
        else:
            assert not pieces
            assert "".join(c.delta.content or "" for c in mine) == "21 °C in Paris."
