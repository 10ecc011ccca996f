"""Workers sharing a study measure each (precision, KV) pair once: the first to claim it in the
storage measures, the others wait for its figure, so every trial of a pair carries the same one.
The measurement is a stand-in (real engines measure in the runner tests); the claims are real
rows in a real SQLite file, and the workers really run at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import optuna
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from objectives.quality import QualityFigure
from tuner.quality import QualityBook
from tuner.storage import QualityClaim, claim_pair, open_storage, release_pair

CONFIG = {"quantization": "w8a8", "kv_compression": 0.5}


class _SlowMeasure:
    """Each call takes a while and returns a different figure: were a pair measured twice, its
    trials would carry different figures."""

    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, config, session, prompts):
        with self.lock:
            self.calls += 1
            kl = 0.01 * self.calls
        time.sleep(0.5)
        return QualityFigure(kl=kl, source="measured", note="stand-in", samples=100)


def _worker_book(url: str, measure: _SlowMeasure) -> QualityBook:
    storage = open_storage(url, 60)
    study = optuna.load_study(study_name="q", storage=storage)
    book = QualityBook(study, measure, None, ["text"], log=lambda line: None)
    book.claim = lambda pair: claim_pair(storage, "q", pair, stale_after_s=900)
    return book


def test_two_workers_measuring_one_pair_at_once_measure_it_once(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    optuna.create_study(
        storage=open_storage(url, 60), study_name="q", directions=["minimize", "maximize"]
    )
    measure = _SlowMeasure()
    books = [_worker_book(url, measure) for _ in range(2)]
    start = threading.Barrier(2)

    def trial(book: QualityBook) -> None:
        start.wait()
        book.session_hook(CONFIG)(object())

    threads = [threading.Thread(target=trial, args=(book,)) for book in books]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert measure.calls == 1
    figures = [book.trial_attrs(CONFIG)["quality_kl"] for book in books]
    assert figures == [0.01, 0.01]


def test_a_claim_whose_holder_died_is_taken_over_once_stale(tmp_path: Path):
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", 60)
    assert claim_pair(storage, "q", "w8a8@0.5", stale_after_s=900)
    assert not claim_pair(storage, "q", "w8a8@0.5", stale_after_s=900)  # held, fresh
    assert claim_pair(storage, "q", "w4a16@1", stale_after_s=900)  # another pair is free
    with Session(storage.engine) as session, session.begin():
        session.execute(
            update(QualityClaim)
            .where(QualityClaim.pair == "w8a8@0.5")
            .values(claimed_at=datetime.now(timezone.utc) - timedelta(seconds=901))
        )
    assert claim_pair(storage, "q", "w8a8@0.5", stale_after_s=900)  # its holder is gone
    assert not claim_pair(storage, "q", "w8a8@0.5", stale_after_s=900)  # and now it is held


def test_a_fresh_claim_of_a_process_gone_from_this_host_is_taken_over_at_once(tmp_path: Path):
    """A worker killed holding a claim, or a study deleted and recreated under its name, left
    a fresh claim row: its holder (host:pid) is a process of this host that no longer runs,
    so the next trial takes it over now, not 900 s later; a live holder's claim stays."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", 60)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    with Session(storage.engine) as session, session.begin():
        for pair, pid in (("w8a8@0.5", gone.stdout.strip()), ("w4a16@1", str(os.getppid()))):
            session.add(
                QualityClaim(
                    study_name="q", pair=pair, holder=f"{socket.gethostname()}:{pid}",
                    claimed_at=datetime.now(timezone.utc),
                )
            )  # fmt: skip
    assert claim_pair(storage, "q", "w8a8@0.5", stale_after_s=900)
    assert not claim_pair(storage, "q", "w4a16@1", stale_after_s=900)  # its holder runs


class _FlakyReference:
    """The runner's prepare_quality (the bf16 reference, started alone) as a stand-in: it fails
    the first `failures` times, as when another worker's engine holds the memory."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def __call__(self, config, prompts):
        from runners.quality import QualityUnavailable

        self.calls += 1
        if self.calls <= self.failures:
            raise QualityUnavailable("the reference engine did not start: out of memory")


def _book_with_reference(tmp_path: Path, failures: int) -> tuple[QualityBook, _SlowMeasure]:
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 's.db'}", directions=["minimize", "maximize"]
    )
    measure = _SlowMeasure()
    book = QualityBook(
        study, measure, None, ["text"], prepare=_FlakyReference(failures), log=lambda line: None
    )
    return book, measure


def _trial(book: QualityBook) -> None:
    book.before_session(CONFIG)
    hook = book.session_hook(CONFIG)
    assert hook is not None
    hook(object())


def test_a_reference_that_fails_once_is_tried_again_in_a_later_trial(tmp_path: Path):
    book, measure = _book_with_reference(tmp_path, failures=1)
    _trial(book)
    assert measure.calls == 0  # not beside the trial's engine, and nothing recorded for good
    assert "quality_kl" not in book.trial_attrs(CONFIG)
    _trial(book)
    assert measure.calls == 1 and book.trial_attrs(CONFIG)["quality_kl"] == 0.01


def test_a_reference_that_keeps_failing_ends_measurement_with_its_reason(tmp_path: Path):
    book, measure = _book_with_reference(tmp_path, failures=99)
    for _ in range(4):
        _trial(book)
    assert measure.calls == 0 and book.prepare.calls == 3  # three tries, then no more
    assert "out of memory" in book.trial_attrs(CONFIG)["quality_note"]


def test_a_measurement_cut_short_gives_its_claim_back(tmp_path: Path):
    """Ctrl-C inside the measurement: no figure, no reason, and the claim is given back, so the
    next trial of the pair measures it instead of waiting for a worker that is gone."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    optuna.create_study(
        storage=open_storage(url, 60), study_name="q", directions=["minimize", "maximize"]
    )

    def interrupted(config, session, prompts):
        raise KeyboardInterrupt

    book = _worker_book(url, _SlowMeasure())
    storage = open_storage(url, 60)
    book.measure = interrupted
    book.release = lambda pair: release_pair(storage, "q", pair)
    with pytest.raises(KeyboardInterrupt):
        book.session_hook(CONFIG)(object())
    assert claim_pair(storage, "q", "w8a8@0.5", stale_after_s=900)  # free again
