"""The router's policy (omnivox/replicas/routing.py) and the request digests, without Ray."""
from __future__ import annotations

import hashlib
import json
from collections import Counter

from omnivox.replicas.digest import PREFIX_BYTES, request_digest
from omnivox.replicas.routing import Call, choose, home_replica

IDLE = {"a": 0, "b": 0, "c": 0}


def test_a_pinned_session_goes_only_to_its_replica_however_busy():
    load = {"a": 50, "b": 0}
    assert choose(Call(session_id="s"), load, {"s": "a"}, imbalance=4) == [["a"]]


def test_a_new_session_goes_to_the_least_loaded_then_anywhere():
    assert choose(Call(session_id="new"), {"a": 3, "b": 1, "c": 2}, {}, 4) == [["b"], ["a", "b", "c"]]
    # its replica died (gone from the live set): placed again like a new one
    assert choose(Call(session_id="s"), {"a": 3, "b": 1}, {"s": "dead"}, 4) == [["b"], ["a", "b"]]


def test_a_digest_has_one_home_while_loads_are_even():
    homes = {choose(Call(prefix_digest="ab" * 32), dict(IDLE, a=i % 3), {}, 4)[0][0] for i in range(10)}
    assert homes == {home_replica("ab" * 32, list(IDLE))}
    # strict (one rank): Serve waits for the home's room rather than sending the call elsewhere
    assert choose(Call(prefix_digest="ab" * 32), IDLE, {}, 4) == [[home_replica("ab" * 32, list(IDLE))]]


def test_digests_spread_over_the_replicas():
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(300)]
    spread = Counter(choose(Call(prefix_digest=d), IDLE, {}, 4)[0][0] for d in digests)
    assert set(spread) == set(IDLE) and min(spread.values()) > 60


def test_a_hot_home_spills_to_the_least_loaded_past_the_threshold():
    digest = "f" * 64
    home = home_replica(digest, ["a", "b"])
    other = "b" if home == "a" else "a"
    assert choose(Call(prefix_digest=digest), {home: 4, other: 0}, {}, 4)[0] == [home]  # 4 deeper: stays
    assert choose(Call(prefix_digest=digest), {home: 5, other: 0}, {}, 4)[0] == [other]  # 5 deeper: spills


def test_a_named_replica_is_strict_and_an_unknown_name_goes_anywhere():
    assert choose(Call(replica="c"), IDLE, {}, 4) == [["c"]]
    assert choose(Call(replica="gone"), IDLE, {}, 4) == [["a", "b", "c"]]
    assert choose(Call(), IDLE, {}, 4) == [["a", "b", "c"]]
    assert choose(Call(), {}, {}, 4) == []


def test_a_replica_that_is_not_ready_takes_only_what_must_go_to_it():
    digest = "f" * 64
    home = home_replica(digest, ["a", "b"])
    other = "b" if home == "a" else "a"
    down = frozenset({home})
    assert choose(Call(prefix_digest=digest), {home: 0, other: 3}, {}, 4, down) == [[other]]
    assert choose(Call(), {home: 0, other: 3}, {}, 4, down) == [[other]]
    assert choose(Call(session_id="new"), {home: 0, other: 3}, {}, 4, down) == [[other], [other]]
    # its pinned sessions and calls naming it still reach it (they fail there, visibly)
    assert choose(Call(session_id="s"), {home: 0, other: 3}, {"s": home}, 4, down) == [[home]]
    assert choose(Call(replica=home), {home: 0, other: 3}, {}, 4, down) == [[home]]
    # the other digests keep their homes; with no replica ready, every replica is a candidate
    keeps = [d for d in (hashlib.sha256(str(i).encode()).hexdigest() for i in range(20))
             if home_replica(d, ["a", "b"]) == other]
    assert keeps and all(choose(Call(prefix_digest=d), {home: 0, other: 0}, {}, 4, down)[0] == [other] for d in keeps)
    assert choose(Call(), {"a": 0, "b": 0}, {}, 4, frozenset({"a", "b"})) == [["a", "b"]]


def chat(messages, model="m") -> bytes:
    return json.dumps({"model": model, "messages": messages, "stream": True}).encode()


def test_chat_digest_is_the_conversation_prefix():
    system = {"role": "system", "content": "x" * PREFIX_BYTES}
    one = request_digest("/v1/chat/completions", chat([system, {"role": "user", "content": "first"}]))
    two = request_digest("/v1/chat/completions", chat([system, {"role": "user", "content": "second"}]))
    assert one == two  # the first 4 KiB agree: one replica, its prefix cache
    short = [request_digest("/v1/chat/completions", chat([{"role": "user", "content": q}])) for q in ("a", "b")]
    assert short[0] != short[1]
    assert request_digest("/v1/chat/completions", chat([system], model="other")) != one
    # the key order of the body does not matter; the options outside the prompt do not either
    reordered = json.dumps({"messages": [system, {"role": "user", "content": "first"}], "model": "m",
                            "max_tokens": 3}).encode()
    assert request_digest("/v1/chat/completions", reordered) == one


def test_every_turn_of_a_conversation_has_its_first_turns_digest():
    system = {"role": "system", "content": "You answer briefly."}
    turn = [system, {"role": "user", "content": "what is 2 + 2?"}]
    later = turn + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "and times 3?"},
                    {"role": "assistant", "content": "12"}, {"role": "user", "content": "thanks"}]
    first = request_digest("/v1/chat/completions", chat(turn))
    assert request_digest("/v1/chat/completions", chat(later)) == first
    assert request_digest("/v1/chat/completions", chat([system, {"role": "user", "content": "hi"}])) != first
    # a head past PREFIX_BYTES is cut: a long system prompt alone decides, whatever the question
    long = {"role": "user", "content": "y" * PREFIX_BYTES}
    assert request_digest("/v1/chat/completions", chat([long])) == \
        request_digest("/v1/chat/completions", chat([{"role": "user", "content": "y" * PREFIX_BYTES + "z"}]))


def test_a_session_key_decides_alone():
    a = chat([{"role": "user", "content": "first conversation"}])
    b = chat([{"role": "user", "content": "another one"}])
    assert request_digest("/v1/chat/completions", a, "s1") == request_digest("/v1/chat/completions", b, "s1")
    assert request_digest("/v1/chat/completions", a, "s1") != request_digest("/v1/chat/completions", a, "s2")
    speech = request_digest("/v1/audio/speech", b'{"voice": "ethan"}', "s1")
    assert speech == request_digest("/v1/chat/completions", a, "s1")
    # a chat's `user` is its session key, unless the header names one
    user = json.dumps({"model": "m", "user": "u7", "messages": [{"role": "user", "content": "x"}]}).encode()
    other = json.dumps({"model": "m", "user": "u7", "messages": [{"role": "user", "content": "y"}]}).encode()
    assert request_digest("/v1/chat/completions", user) == request_digest("/v1/chat/completions", other)
    assert request_digest("/v1/chat/completions", user, "s1") == request_digest("/v1/chat/completions", a, "s1")
    assert request_digest("/v1/models", b"", "s1") is None


def test_speech_digest_is_the_voice_and_no_digest_elsewhere():
    a = request_digest("/v1/audio/speech", b'{"input": "hello", "voice": "ethan"}')
    assert a == request_digest("/v1/audio/speech", b'{"voice": "ethan", "input": "other text"}')
    assert a != request_digest("/v1/audio/speech", b'{"input": "hello", "voice": "aiden"}')
    assert request_digest("/v1/audio/speech", b"not json") is None
    assert request_digest("/v1/audio/speech", b"[1]") is None
    assert request_digest("/v1/models", b"") is None
