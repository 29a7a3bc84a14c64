"""The tools users point at an OpenAI-compatible server, unchanged, against a real `tokenbus
serve`: lm-evaluation-harness's `local-completions` (loglikelihood, multiple choice and rolling
perplexity on a tiny inline dataset) and a LangChain `bind_tools` agent round trip."""

from __future__ import annotations

import json
import math
from typing import Literal

import pytest

from tests.fixtures.server import ServerProcess

DOCS = [
    {"question": "The sky is", "choices": [" blue", " green"], "label": 0},
    {"question": "Two plus two is", "choices": [" four", " five", " six"], "label": 0},
    {"question": "Water is", "choices": [" wet", " dry"], "label": 0},
]
TEXTS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Hello world, this is a test."},
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with ServerProcess(
        str(tiny_llama_dir),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        log_dir=tmp_path_factory.mktemp("eval-clients"),
    ) as server:
        yield server


def _write_tasks(root, data_dir) -> None:
    (data_dir / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (data_dir / "text.jsonl").write_text("".join(json.dumps(d) + "\n" for d in TEXTS))
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data_dir / "mc.jsonl"}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (root / "tiny_ppl.yaml").write_text(f"""task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data_dir / "text.jsonl"}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""")


@pytest.mark.slow
def test_lm_eval_local_completions_loglikelihood_and_rolling(server, tiny_llama_dir, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    _write_tasks(tmp_path, data_dir)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=tiny,base_url={server.url}/v1/completions,tokenizer={tiny_llama_dir},"
        "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,timeout=60",
        tasks=["tiny_mc", "tiny_ppl"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    mc = results["results"]["tiny_mc"]
    assert 0.0 <= mc["acc,none"] <= 1.0
    ppl = results["results"]["tiny_ppl"]["word_perplexity,none"]
    assert math.isfinite(ppl) and ppl > 1.0
    # Every choice was scored: a finite loglikelihood per (question, choice).
    scores = [resp[0][0] for sample in results["samples"]["tiny_mc"] for resp in sample["resps"]]
    assert len(scores) == sum(len(d["choices"]) for d in DOCS) and all(
        s < 0 and math.isfinite(s) for s in scores
    )


def test_langchain_bind_tools_agent_round_trip(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def forecast(city: Literal["Paris", "Rome"]) -> str:  # an enum: a random tiny model's call ends
        """The weather forecast for a city."""
        return f"Sunny in {city}."

    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model="tiny",
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )
    agent = llm.bind_tools([forecast], tool_choice="required")
    messages = [HumanMessage("What is the weather in Paris?")]
    reply = agent.invoke(messages)
    [call] = reply.tool_calls[:1]
    assert call["name"] == "forecast" and call["args"]["city"] in ("Paris", "Rome") and call["id"]
    messages += [reply, ToolMessage(forecast.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([forecast]).invoke(messages)  # tool_choice auto: the model decides
    assert final.content or final.tool_calls


def test_responses_api_with_the_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.responses.create(
        model="tiny", input="Say hi.", instructions="Be brief.", max_output_tokens=5, temperature=0
    )
    assert first.status == "incomplete" and first.usage.output_tokens == 5 and first.output_text
    events = list(
        client.responses.create(
            model="tiny",
            input="Say hi.",
            instructions="Be brief.",
            max_output_tokens=5,
            temperature=0,
            stream=True,
        )
    )
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == first.output_text
    )
    follow = client.responses.create(
        model="tiny", input="Again.", previous_response_id=first.id, max_output_tokens=3
    )
    assert follow.usage.input_tokens > first.usage.input_tokens  # the earlier turn is in the prompt
    assert client.responses.retrieve(first.id).id == first.id
