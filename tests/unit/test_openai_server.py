"""The OpenAI-compatible endpoint, driven by the real ``openai`` client over loopback HTTP.

Agent code written for the OpenAI client runs unchanged, and the session's trajectory is
token for token what the model saw and produced: with a tokenizer whose merges make
decode-then-encode change the ids, the trajectory still holds the sampled ids.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.test_envs_runner import OracleLM, calc_env, planned
from workers.envs.base import StepKey
from workers.envs.calculator import CALCULATOR_FORMAT
from workers.envs.chat import PlainTemplate
from workers.envs.recorder import InMemoryTurnRecorder
from workers.envs.runner import EpisodeRunner
from workers.envs.sampler import TorchTurnSampler
from workers.generator.openai_server import OpenAIServer
from workers.models.config import SamplingSection
from workers.models.tiny import TinyCausalLM, TinyConfig
from workers.models.tokenizer import EOS_ID, CharTokenizer

openai = pytest.importorskip("openai", reason="the envs extra (pip install -e '.[envs]')")

TOK = CharTokenizer()


def serve(model, tokenizer, *, tools=CALCULATOR_FORMAT, seed=0, context_len=32):  # type: ignore[no-untyped-def]
    sampler = TorchTurnSampler(model, tokenizer.eos_id, SamplingSection(max_new_tokens=8),
                               torch.Generator().manual_seed(seed))
    return OpenAIServer(sampler, PlainTemplate(tokenizer, tools), context_len, max_tokens=8).start()


def client(server, session: str):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server.session_url(session), api_key="unused", max_retries=0)


def calculator_agent(llm, question: str) -> str:  # type: ignore[no-untyped-def]
    """Plain OpenAI-client agent code: call the tool when asked, return the answer."""
    messages = [{"role": "user", "content": question}]
    while True:
        reply = llm.chat.completions.create(model="policy", messages=messages)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            result = CALCULATOR_FORMAT.tool(call.function.name).run(args)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def test_openai_agent_code_trains_on_the_ids_the_episode_runner_would_produce():
    model = OracleLM(planned("47*38=", "47*38", ">1786", "1786"), TOK.vocab_size)
    server = serve(model, TOK)
    try:
        answer = calculator_agent(client(server, "ep-1"), "47*38=")
        served = server.trajectory("ep-1")
    finally:
        server.close()
    assert answer == "1786"
    runner = EpisodeRunner(TorchTurnSampler(model, EOS_ID, SamplingSection(max_new_tokens=8),
                                            torch.Generator()),
                           TOK, InMemoryTurnRecorder(), 32, 8, 2, "calculator")
    (ran,) = runner.run([StepKey("run", "ep-1", 0, 0)], [calc_env()])
    assert served.input_ids == ran.input_ids
    assert served.loss_mask == ran.loss_mask
    assert [(t.start, t.end) for t in served.turns] == [(t.start, t.end) for t in ran.turns]


def test_response_carries_token_ids_logprobs_and_a_tool_call():
    model = OracleLM(planned("47*38=", "47*38", ">1786", "1786"), TOK.vocab_size)
    with serve(model, TOK) as server:
        reply = client(server, "ep-2").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "47*38="}], logprobs=True)
        traj = server.trajectory("ep-2")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "47*38"}
    extra = choice.model_extra
    assert extra["token_ids"] == TOK.encode("47*38") + [EOS_ID]
    assert extra["prompt_token_ids"] == TOK.encode("47*38=")
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
        traj.logprobs[6:12], abs=0)
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens == 6


def merging_tokenizer():  # type: ignore[no-untyped-def]
    """An HF BPE tokenizer whose merges join letter pairs: 'a'+'b' re-encodes as 'ab'."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from workers.models.hf import HFTokenizer

    letters = "abcd"
    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(letters + "?")}}
    merges = [(x, y) for x in letters for y in letters]
    for x, y in merges:
        vocab[x + y] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>")
    return HFTokenizer(fast)


def test_token_in_token_out_where_re_encoding_would_drift():
    tok = merging_tokenizer()
    model = TinyCausalLM(TinyConfig(vocab_size=tok.vocab_size, context_len=64, d_model=32, n_heads=2))
    with serve(model, tok, tools=None, seed=3, context_len=64) as server:
        llm = client(server, "ep-3")
        messages = [{"role": "user", "content": "abcd?"}]
        first = llm.chat.completions.create(model="policy", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "dcba?"}]
        second = llm.chat.completions.create(model="policy", messages=messages)
        traj = server.trajectory("ep-3")
    turns = [c.choices[0].model_extra["token_ids"] for c in (first, second)]
    expected = tok.encode("abcd?") + turns[0] + tok.encode("dcba?") + turns[1]
    assert traj.input_ids == expected
    assert traj.loss_mask == ([False] * 3 + [True] * len(turns[0]) + [False] * 3
                              + [True] * len(turns[1]))
    # the test can fail: re-encoding what the model said would have changed its ids
    assert any(tok.encode(tok.decode(t)) != [i for i in t if i != tok.eos_id] for t in turns)


def test_a_changed_history_is_refused_with_the_reason():
    model = OracleLM(planned("47*38=", "47*38", ">1786", "1786"), TOK.vocab_size)
    with serve(model, TOK) as server:
        llm = client(server, "ep-4")
        messages = [{"role": "user", "content": "47*38="}]
        reply = llm.chat.completions.create(model="policy", messages=messages)
        edited = reply.choices[0].message.model_dump(exclude_none=True)
        edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"expression": "47*39"})
        with pytest.raises(openai.BadRequestError, match=r"message 1 \(assistant\) differs"):
            llm.chat.completions.create(model="policy", messages=messages + [
                edited, {"role": "tool", "tool_call_id": "x", "content": "1833"}])


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"n": 2}, "n must be 1"),
        ({"temperature": 0.5}, "temperature must be 1.0"),
        ({"extra_body": {"top_k": 5}}, r"unsupported request field\(s\) \['top_k'\]"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs is not offered"),
        ({"tool_choice": "none"}, "tool_choice 'none' is not offered"),
        ({"tools": [{"type": "function", "function": {"name": "search"}}]},
         r"tools\[0\]: tool 'search' is not one this model calls \(its tools: \['calculator'\]\)"),
    ],
)
def test_requests_the_session_cannot_serve_exactly_are_refused(kwargs, reason):  # type: ignore[no-untyped-def]
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    with serve(model, TOK) as server:
        with pytest.raises(openai.BadRequestError, match=reason):
            client(server, "ep-5").chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "47*38="}], **kwargs)


def test_the_session_may_come_in_the_body_on_the_plain_path():
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    with serve(model, TOK) as server:
        plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no session"):
            plain.chat.completions.create(model="p", messages=[{"role": "user", "content": "1"}])
        plain.chat.completions.create(model="p", messages=[{"role": "user", "content": "47*38="}],
                                      extra_body={"session_id": "ep-6"})
        assert server.trajectory("ep-6").input_ids[:6] == TOK.encode("47*38=")


def test_a_generator_serves_its_model_and_the_turn_records_the_weight_version():
    from workers.dataplane import MemoryDataPlane
    from workers.generator import Generator
    from workers.models.config import ModelSection
    from workers.models.factory import build_model
    from workers.tasks import make_task
    from workers.weight_sync import cpu_state_dict

    model, tok = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 1)
    gen = Generator(model, tok, make_task("calculator"), MemoryDataPlane(), "run-9")
    newer, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 2)
    sampling = SamplingSection(max_new_tokens=8)
    with OpenAIServer.for_generator(gen, sampling, CALCULATOR_FORMAT) as server:
        llm = client(server, "ep-7")
        messages = [{"role": "user", "content": "12+34="}]
        first = llm.chat.completions.create(model="policy", messages=messages)
        gen.update_weights(3, cpu_state_dict(newer))  # a refit between two turns
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "?"}]
        second = llm.chat.completions.create(model="policy", messages=messages)
        traj = server.trajectory("ep-7")
    assert first.model_extra["weight_version"] == [0, 0]
    assert second.model_extra["weight_version"] == [3, 3]
    assert [(t.version_start, t.version_end) for t in traj.turns] == [(0, 0), (3, 3)]
    assert traj.key.run == "run-9"


def test_a_message_that_is_not_an_object_gets_a_400_not_a_dropped_connection():
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    with serve(model, TOK) as server:
        with pytest.raises(openai.BadRequestError, match="message 0 must be a JSON object, got str"):
            client(server, "ep-8").chat.completions.create(model="policy", messages=["47*38="])


def test_a_refused_request_leaves_the_session_as_it_was():
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    with serve(model, TOK, context_len=16) as server:
        llm = client(server, "ep-9")
        with pytest.raises(openai.BadRequestError, match="message 1 cannot be encoded"):
            llm.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": "47*38"}, {"role": "user", "content": "é"}])
        with pytest.raises(openai.BadRequestError, match="leaves no room"):
            llm.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": "47*38"}, {"role": "user", "content": "=" * 11}])
        # the corrected request is served from the start: no message lost or held twice
        reply = llm.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "47*38"}, {"role": "user", "content": "="}])
        traj = server.trajectory("ep-9")
    assert reply.choices[0].model_extra["prompt_token_ids"] == TOK.encode("47*38=")
    assert traj.input_ids == TOK.encode("47*38=") + reply.choices[0].model_extra["token_ids"]


class FailsOnce:
    """A sampler whose first call fails (a model fault mid-request), then samples."""

    def __init__(self, sampler):  # type: ignore[no-untyped-def]
        self.sampler, self.calls = sampler, 0

    def generate(self, requests):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("device lost")
        return self.sampler.generate(requests)


def test_a_sampler_fault_is_a_500_line_and_the_retry_is_served_whole():
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    sampler = FailsOnce(TorchTurnSampler(model, EOS_ID, SamplingSection(max_new_tokens=8),
                                         torch.Generator()))
    messages = [{"role": "user", "content": "47*38="}]
    with OpenAIServer(sampler, PlainTemplate(TOK, CALCULATOR_FORMAT), 32) as server:
        llm = client(server, "ep-10")
        with pytest.raises(openai.InternalServerError, match="RuntimeError: device lost"):
            llm.chat.completions.create(model="policy", messages=messages)
        reply = llm.chat.completions.create(model="policy", messages=messages)
        traj = server.trajectory("ep-10")
    assert traj.input_ids == TOK.encode("47*38=") + reply.choices[0].model_extra["token_ids"]
    assert len(traj.turns) == 1


class Counting:
    def __init__(self, sampler):  # type: ignore[no-untyped-def]
        self.sampler, self.calls = sampler, 0

    def generate(self, requests):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.sampler.generate(requests)


def test_a_client_retry_of_a_served_request_gets_the_same_reply_sampled_once():
    """The OpenAI client resends a request whose reply it lost (a timeout, a dropped
    connection): the turn was sampled and is in the trajectory, so the resend is
    answered from it, not refused and not sampled again."""
    model = OracleLM(planned("47*38=", "47*38", ">1786", "1786"), TOK.vocab_size)
    sampler = Counting(TorchTurnSampler(model, EOS_ID, SamplingSection(max_new_tokens=8),
                                        torch.Generator()))
    messages = [{"role": "user", "content": "47*38="}]
    with OpenAIServer(sampler, PlainTemplate(TOK, CALCULATOR_FORMAT), 32) as server:
        llm = client(server, "ep-11")
        first = llm.chat.completions.create(model="policy", messages=messages)
        again = llm.chat.completions.create(model="policy", messages=messages)
        messages += [again.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "x", "content": "1786"}]
        llm.chat.completions.create(model="policy", messages=messages)
        traj = server.trajectory("ep-11")
    assert again.model_dump() == first.model_dump()
    assert sampler.calls == 2 and len(traj.turns) == 2
    assert traj.input_ids == TOK.encode("47*38=47*38") + [EOS_ID] + TOK.encode(">1786") \
        + TOK.encode("1786") + [EOS_ID]


def test_a_get_or_a_query_string_is_answered_in_json():
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    with serve(model, TOK) as server:
        with pytest.raises(openai.NotFoundError, match="only POST .../v1/chat/completions"):
            client(server, "ep-12").models.list()
        client(server, "ep-12").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "47*38="}],
            extra_query={"api-version": "1"})
        assert server.trajectory("ep-12").input_ids[:6] == TOK.encode("47*38=")


def test_a_replayed_session_that_asks_otherwise_is_a_400_naming_the_turn():
    """A session served again from its record (a new server over the same recorder, as
    after a restart) by an agent that does not repeat itself: the agent's fault, said in
    one line, not a server failure the client would retry."""
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    recorder = InMemoryTurnRecorder()

    def fresh() -> OpenAIServer:
        sampler = TorchTurnSampler(model, EOS_ID, SamplingSection(max_new_tokens=8),
                                   torch.Generator())
        return OpenAIServer(sampler, PlainTemplate(TOK, CALCULATOR_FORMAT), 32,
                            recorder=recorder).start()

    with fresh() as server:
        first = client(server, "ep-13").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "47*38="}])
    with fresh() as server:
        replayed = client(server, "ep-13").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "47*38="}])
        assert replayed.choices[0].model_extra["token_ids"] == first.choices[0].model_extra["token_ids"]
    with fresh() as server:
        with pytest.raises(openai.BadRequestError, match=r"model turn run/ep-13/s0/t1: the agent "
                           r"asked for a different turn than the recorded one"):
            client(server, "ep-13").chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "12+34="}])


def test_a_server_never_started_closes():
    # shutdown() alone waits for a serve loop that never ran: this test would hang
    server = OpenAIServer(Counting(None), PlainTemplate(TOK, CALCULATOR_FORMAT), 32)
    server.close()
    assert server.sessions == {}


class Echo:
    """A tool called by ':': ':<letters>' is a call, ':' then anything else is malformed."""

    name, marker = "echo", ":"

    def parse(self, raw):  # type: ignore[no-untyped-def]
        from workers.envs.base import ToolCallParseError

        if not raw.isalpha():
            raise ToolCallParseError(f"echo call {':' + raw!r} does not parse: expected :<letters>")
        return {"text": raw}

    def run(self, arguments):  # type: ignore[no-untyped-def]
        return arguments["text"]


def test_a_turn_that_starts_like_a_call_but_does_not_parse_says_why():
    from workers.envs.tools import ToolCallFormat

    model = OracleLM(planned("1?", ":12", ">x", ":ab"), TOK.vocab_size)
    with serve(model, TOK, tools=ToolCallFormat((Echo(),))) as server:
        llm = client(server, "ep-14")
        messages = [{"role": "user", "content": "1?"}]
        bad = llm.chat.completions.create(model="policy", messages=messages)
        messages += [bad.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "x", "content": "x"}]
        good = llm.chat.completions.create(model="policy", messages=messages)
    assert bad.choices[0].message.content == ":12" and not bad.choices[0].message.tool_calls
    assert bad.choices[0].model_extra["tool_call_error"] == (
        "echo call ':12' does not parse: expected :<letters>")
    assert good.choices[0].message.tool_calls[0].function.name == "echo"
    assert "tool_call_error" not in good.choices[0].model_extra


@pytest.mark.parametrize("session", ["ep 15", "run/g15/s0", "épisode-15"])
def test_a_session_id_with_a_slash_a_space_or_non_ascii_is_its_own_session(session):  # type: ignore[no-untyped-def]
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    with serve(model, TOK) as server:
        reply = client(server, session).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "47*38="}])
        traj = server.trajectory(session)
    assert traj.input_ids == TOK.encode("47*38=") + reply.choices[0].model_extra["token_ids"]


def test_unsupported_fields_sent_as_null_ask_for_nothing():
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    with serve(model, TOK) as server:
        reply = client(server, "ep-16").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "47*38="}],
            extra_body={"stop": None, "user": None, "response_format": None})
    assert reply.choices[0].model_extra["token_ids"] == TOK.encode("47*38") + [EOS_ID]


def test_a_message_without_text_content_names_what_it_holds():
    model = OracleLM(planned("47*38=", "47*38"), TOK.vocab_size)
    with serve(model, TOK) as server:
        with pytest.raises(openai.BadRequestError, match=r"message 0: expected role "
                           r"system/developer/user/tool with text content, got role 'tool' "
                           r"with content NoneType"):
            client(server, "ep-17").chat.completions.create(
                model="policy", messages=[{"role": "tool", "tool_call_id": "x", "content": None}])


def test_an_ended_session_is_freed_and_a_later_request_to_it_is_a_404_naming_it():
    """A server that opens sessions on request: ending one frees its state (its
    session, its last reply and its turns in the server's own record), and a request
    naming it afterwards is refused, not served as a new episode nobody will end."""
    from tests.unit.test_agent_task import held_by
    from workers.envs.chat import ChatSession
    from workers.envs.recorder import ModelTurn
    from workers.envs.trajectory import Trajectory

    model = OracleLM(planned("47*38=", "47*38", ">1786", "1786"), TOK.vocab_size)
    with serve(model, TOK) as server:
        for n in range(4):
            assert calculator_agent(client(server, f"ep-{n}"), "47*38=") == "1786"
            assert len(server.end_session(f"ep-{n}").turns) == 2
        assert server.sessions == {}
        assert held_by(server, (ChatSession, ModelTurn, Trajectory)) == []
        with pytest.raises(openai.NotFoundError, match=r"session 'ep-2' has ended"):
            client(server, "ep-2").chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "47*38="}])
        with pytest.raises(KeyError, match="ep-2"):
            server.end_session("ep-2")
        assert server.sessions == {}
