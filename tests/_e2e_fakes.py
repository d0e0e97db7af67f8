"""Fakes for bench/e2e.py's tests: a clock under which every job takes a given time (no real
waiting), and a spy on the jobs run."""
from typing import Any, List


def jobs_take(monkeypatch: Any, e2e: Any, seconds: float) -> List[float]:
    """Patch ``e2e.clock`` and ``e2e.run_job``; returns the clock's one-item list (tests may
    move it)."""
    now = [0.0]
    real = e2e.run_job

    def timed(*args: Any, **kwargs: Any) -> Any:
        now[0] += seconds
        return real(*args, **kwargs)

    monkeypatch.setattr(e2e, "clock", lambda: now[0])
    monkeypatch.setattr(e2e, "run_job", timed)
    return now


def jobs_run(monkeypatch: Any, e2e: Any) -> List[str]:
    """The names of the methods ``e2e.run_job`` runs from now on, in order (plain training's
    reference included), each still run for real."""
    ran: List[str] = []
    real = e2e.run_job

    def spy(method: Any, *args: Any, **kwargs: Any) -> Any:
        ran.append(method.name)
        return real(method, *args, **kwargs)

    monkeypatch.setattr(e2e, "run_job", spy)
    return ran
