"""Harmony channels: `final` becomes content, `analysis` reasoning_content, whole or streamed.

The channel parser is checked on every way a stream can cut the text; the chat reply on a scripted
engine stream (an engine double: it isolates the server's formatting from model outputs,
which for random tiny weights never form harmony messages).
"""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflash.chat.deltas import ChatMessage
from pdflash.chat.families import HARMONY, TurnSetup
from pdflash.chat.harmony import speaks_harmony, split_channels
from pdflash.chat.harmony_calls import HarmonyChannels
from pdflash.engine.outputs import RequestMetrics, RequestOutput
from pdflash.server.chat import ChatSetup, ChatTurn
from pdflash.server.completions import _Reply
from pdflash.server.metrics import ServerMetrics, StatsBoard
from pdflash.server.state import ServerSettings, ServerState
from pdflash.target.tiny import write_tiny_target
from pdflash.target.tiny_gpt_oss import TINY_GPT_OSS_CONFIG, write_tiny_gpt_oss
from pdflash.target.tokenizer import TextTokenizer

REASONING = "User says hi. Reply <politely> | briefly."
ANSWER = "Hello! How can I help?"
COMPLETION = (  # what gpt-oss writes after the prompt's <|start|>assistant
    f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)


def stream_of(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def streamed_split(deltas: list[str]) -> tuple[str, str]:
    parser = HarmonyChannels()
    message = ChatMessage.assemble([*(parser.feed(d) for d in deltas), parser.finish()])
    return message.content, message.reasoning


def test_whole_completion_splits_into_final_and_analysis():
    assert split_channels(COMPLETION) == (ANSWER, REASONING)


def test_commentary_goes_to_content_and_a_cut_off_body_is_kept():
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
    assert split_channels(text) == ("{}", "")
    assert split_channels("<|channel|>analysis<|message|>thinking, then the length limit") == (
        "",
        "thinking, then the length limit",
    )


def test_character_by_character_stream_equals_whole():
    assert streamed_split(list(COMPLETION)) == (ANSWER, REASONING)


@given(st.lists(st.integers(min_value=0, max_value=len(COMPLETION)), max_size=12))
def test_any_cut_of_the_stream_equals_whole(cuts):
    assert streamed_split(stream_of(COMPLETION, cuts)) == (ANSWER, REASONING)


def test_only_harmony_tokenizers_are_split(tmp_path):
    gpt_oss = write_tiny_gpt_oss(tmp_path / "g", num_hidden_layers=2, layer_types=None)
    qwen = write_tiny_target(tmp_path / "q")
    assert speaks_harmony(TextTokenizer(gpt_oss, TINY_GPT_OSS_CONFIG["vocab_size"]))
    assert not speaks_harmony(TextTokenizer(qwen, 4096))


class ScriptedEngine:
    """Streams a fixed completion in the given deltas (the engine's generate contract)."""

    def __init__(self, tokenizer, deltas):
        self.tokenizer, self.deltas = tokenizer, deltas

    async def stream(self):
        for i, text in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            metrics = RequestMetrics(
                prompt_tokens=5,
                generated_tokens=i + 1,
                acceptance_lengths=(),
                block_sizes=(),
                ttft_s=0.0,
                expert_bytes=0,
                fetch_bytes=0,
                admission_wait_s=0.0,
            )
            yield RequestOutput(
                request_id="r",
                token_ids=(i,),
                text=text,
                finished=last,
                finish_reason="stop" if last else None,
                metrics=metrics,
            )

    async def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = write_tiny_gpt_oss(tmp_path_factory.mktemp("g"), num_hidden_layers=2, layer_types=None)
    return TextTokenizer(directory, TINY_GPT_OSS_CONFIG["vocab_size"])


def reply_for(engine):
    chat = ChatSetup.create(engine.tokenizer)
    assert chat.family is HARMONY  # found from the template's markers
    state = ServerState(
        engine=engine,
        settings=ServerSettings(model_name="tiny"),
        metrics=ServerMetrics(engine),
        board=StatsBoard(engine, ServerMetrics(engine), "tiny", 1.0),
        started=0,
        chat=chat,
        max_model_len=TINY_GPT_OSS_CONFIG["max_position_embeddings"],
    )
    turn = ChatTurn("", "", chat.family.new_parser(TurnSetup(prompt="", tool_names=None)), chat.end_tokens)
    return _Reply(state, "r", 0, chat=True, ids=["r"], logprobs=False, turns=[turn])


@pytest.mark.anyio
@pytest.mark.parametrize("step", [1, 3, 7])
async def test_streamed_chat_sends_reasoning_and_content_deltas(tokenizer, step):
    engine = ScriptedEngine(tokenizer, [COMPLETION[i : i + step] for i in range(0, len(COMPLETION), step)])
    events = [e async for e in reply_for(engine).events([engine.stream()], include_usage=False)]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # analysis came first
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.anyio
async def test_whole_chat_message_has_reasoning_content(tokenizer):
    engine = ScriptedEngine(tokenizer, [COMPLETION[:20], COMPLETION[20:]])
    body = await reply_for(engine).whole([engine.stream()])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}


def test_served_gpt_oss_chat_is_the_split_of_its_raw_completion(tmp_path):
    """Through a real server on the tiny gpt-oss: whole and streamed chat replies are the channels
    of what /v1/completions returns for the same rendered prompt (random weights write markers at
    random, so the split is exercised on genuine model output)."""
    import httpx

    from pdflash.engine.async_engine import AsyncEngine
    from pdflash.server import BackgroundServer, create_app

    directory = write_tiny_gpt_oss(tmp_path / "g", seed=7)  # its greedy reply holds a <|message|> body
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = TextTokenizer(directory, TINY_GPT_OSS_CONFIG["vocab_size"]).chat_template.render(messages)
    request = {"model": "tiny", "max_tokens": 48, "temperature": 0}
    engine = AsyncEngine.from_pretrained(directory, None, max_num_seqs=2)
    with BackgroundServer(create_app(engine, ServerSettings(model_name="tiny"))) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            raw = http.post("/v1/completions", json=request | {"prompt": prompt}).json()["choices"][0]["text"]
            whole = http.post("/v1/chat/completions", json=request | {"messages": messages}).json()
            streamed = http.post("/v1/chat/completions", json=request | {"messages": messages, "stream": True})
    message = whole["choices"][0]["message"]
    content, reasoning = split_channels(raw)
    assert (message["content"], message.get("reasoning_content", "")) == (content, reasoning)
    deltas = [
        json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(d.get("content", "") for d in deltas) == content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    # this reply has one header and no end marker: the content is everything after its <|message|>
    assert content == raw.split("<|message|>", 1)[1] and reasoning == ""
