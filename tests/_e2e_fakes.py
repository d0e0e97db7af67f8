"""Fakes for bench/e2e.py's tests: a clock under which every job takes a given time (no real
waiting), and a spy on the jobs run. Both patch ``bench.e2e_grid`` (pass it as ``grid``): it
owns ``clock`` and is where ``run_grid`` reads ``run_job``, so a patch on ``bench.e2e`` would
not reach them."""
from typing import Any, List


def jobs_take(monkeypatch: Any, grid: Any, seconds: float) -> List[float]:
    """Patch ``grid.clock`` and ``grid.run_job``; returns the clock's one-item list (tests may
    move it)."""
    now = [0.0]
    real = grid.run_job

    def timed(*args: Any, **kwargs: Any) -> Any:
        now[0] += seconds
        return real(*args, **kwargs)

    monkeypatch.setattr(grid, "clock", lambda: now[0])
    monkeypatch.setattr(grid, "run_job", timed)
    return now


def jobs_run(monkeypatch: Any, grid: Any) -> List[str]:
    """The names of the methods ``grid.run_job`` runs from now on, in order (plain training's
    reference included), each still run for real."""
    ran: List[str] = []
    real = grid.run_job

    def spy(method: Any, *args: Any, **kwargs: Any) -> Any:
        ran.append(method.name)
        return real(method, *args, **kwargs)

    monkeypatch.setattr(grid, "run_job", spy)
    return ran
