"""``hybridkv route serve``: the HTTP API answers what the Python lookup answers, reads a
card again when its engine writes it again, and refuses bad requests naming why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.connector.card import read_card
from hybridkv.groups import GroupKind
from hybridkv.keys import RequestBlockHasher
from hybridkv.route.engines import EngineError, Engines, engine_names
from hybridkv.route.lookup import EngineHits, EngineLookup, HitQuery
from hybridkv.route.server import parse_query
from hybridkv.tools.sim.build import make_config
from hybridkv.tools.sim.model import prompt
from hybridkv.tools.sim.shapes import make_groups
from tests.support.cards import store_through_engine, write_engine_card

ROOT = Path(__file__).resolve().parents[2]
GROUPS = make_groups((GroupKind.SLIDING_WINDOW, GroupKind.FULL))


def post(url: str, body: object) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as response:
        document: dict[str, Any] = json.loads(response.read())
        return document


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Engine ``a`` stored a prompt on disk and wrote its card; ``b`` has no card yet.
    Yields the service's URL and the cards' directory."""
    cards = tmp_path / "cards"
    config = make_config(tmp_path / "a")
    write_engine_card(cards / "a.json", config, GROUPS)
    store_through_engine(GROUPS, config, prompt(41), salt=None)
    argv = [sys.executable, "-m", "hybridkv.cli", "route", "serve", "--port", "0",
            "--card", str(cards / "a.json"), "--card", str(cards / "b.json")]  # fmt: skip
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    url = ""
    deadline = time.monotonic() + 60
    while not url and time.monotonic() < deadline:
        line = process.stdout.readline()
        assert line, f"hybridkv route serve exited with {process.wait()}"
        if " at http://" in line:
            url = line.split(" at ")[1].split()[0]
    assert url.startswith("http://127.0.0.1:"), url
    try:
        yield url, cards
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        process.stdout.close()


def test_the_service_answers_what_the_python_lookup_answers(serve: tuple[str, Path]) -> None:
    url, cards = serve
    card = read_card(cards / "a.json")
    local = EngineLookup("a", card)
    tokens = prompt(41)
    expected = local.find(HitQuery(token_ids=tokens))
    assert expected.hit_tokens > 0
    status, body = post(f"{url}/lookup", {"token_ids": tokens})
    assert status == 200
    a, b = body["engines"]
    assert a == expected.to_dict() and body["best"] == "a"
    assert b["engine"] == "b" and "no card" in b["error"]
    hasher = RequestBlockHasher(GROUPS.hash_block_size)
    hasher.extend(tokens)
    by_hashes = {"block_hashes": [h.hex() for h in hasher.block_hashes], "num_tokens": 41}
    status, body = post(f"{url}/lookup", {**by_hashes, "engines": ["a"]})
    assert status == 200 and body["engines"] == [expected.to_dict()]
    (listed_a, listed_b) = get(f"{url}/engines")["engines"]
    assert listed_a["model_id"] == GROUPS.model_id and listed_a["engine_id"] == card.engine_id
    assert [t["visible"] for t in listed_a["tiers"]] == [False, True]
    assert "error" in listed_b
    # Engine b starts and writes its card (a copy of a's): the next query reads it.
    (cards / "b.json").write_text((cards / "a.json").read_text())
    status, body = post(f"{url}/lookup", {"token_ids": tokens})
    assert [e["hit_tokens"] for e in body["engines"]] == [expected.hit_tokens] * 2
    local.close()


def test_bad_requests_are_refused_naming_every_problem(serve: tuple[str, Path]) -> None:
    url, _ = serve
    status, body = post(f"{url}/lookup", {"token_ids": [1, -2], "salt": "x", "cache_salt": 3})
    assert status == 400
    for part in ("unknown key 'salt'", "negative", "cache_salt=3"):
        assert part in body["error"]
    assert post(f"{url}/lookup", {"token_ids": [1], "engines": ["c"]})[0] == 400
    assert post(f"{url}/nowhere", {})[0] == 404
    request = urllib.request.Request(f"{url}/lookup", data=b"{", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ([], "JSON object"),
        ({"token_ids": [1, True]}, "list of ints"),
        ({"token_ids": [1.5]}, "list of ints"),
        ({"block_hashes": ["zz"]}, "hex strings"),
        ({"token_ids": [1], "block_hashes": []}, "not both"),
        ({"block_hashes": [], "num_tokens": -1}, "num_tokens=-1"),
        ({"token_ids": [1], "engines": "a"}, "list of engine names"),
    ],
)
def test_a_query_body_is_checked(body: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_query(body)


def test_a_card_rewritten_is_read_again_and_a_card_gone_is_an_error(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    path = tmp_path / "a.json"
    write_engine_card(path, config, GROUPS)
    engines = Engines(engine_names([path]))
    (first,) = engines.find(HitQuery(token_ids=prompt(9)))
    assert isinstance(first, EngineHits)
    lookup = engines.entries["a"].lookup
    assert engines.reread()[0].lookup is lookup  # unchanged: kept
    write_engine_card(path, config, make_groups((GroupKind.FULL,)))
    assert engines.reread()[0].lookup is not lookup
    os.remove(path)
    (gone,) = engines.find(HitQuery(token_ids=prompt(9)))
    assert isinstance(gone, EngineError) and "no card" in gone.error
    with pytest.raises(ValueError, match="name the same engine"):
        engine_names([path, tmp_path / "x" / "a.json"])
    engines.close()
