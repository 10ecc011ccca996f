"""Workers sharing a study measure each (precision, KV) pair once: the first to claim it in the
storage measures, the others wait for its figure, so every trial of a pair carries the same one.
The measurement is a stand-in (real engines measure in the runner tests); the claims are real
rows in a real SQLite file, and the workers really run at once."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import optuna
from sqlalchemy import update
from sqlalchemy.orm import Session

from objectives.quality import QualityFigure
from tuner.quality import QualityBook
from tuner.storage import QualityClaim, claim_pair, open_storage

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
