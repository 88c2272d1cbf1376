"""What every `corral bench` command shares, so that each one declares only its own flags and its own work.

- `bench_command`: the command's parser, with the common flags it takes (--data, --server, --server-args, --out,
  --log-level): their defaults and help texts live here once.
- The run (`Bench`): first a check that the benchmark packages are installed (else one sentence naming the
  `bench` extra, exit 2); then a rich console (logging through it when the command takes --log-level), a
  progress bar (`RichProgress`), and `BenchExit` for a refused flag (2) or a failed run (1), printed as
  `corral bench NAME: message`.
- The report: `Bench.table` prints a table, `write_json` writes OUT/results.json (`Bench.write_results` with the
  machine beside the rows), `Bench.plot_path` is OUT/<command>.png, `Bench.wrote` the closing line; `pyplot` and
  `save_figure` draw the PNGs.
- `ServerBenchConfig` and `config_from_args`: a benchmark's configuration from its flags.

This module imports only the standard library: building the `corral bench` parser loads none of the benchmark
packages (rich, matplotlib, httpx), so `corral serve` runs without them."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import platform
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

BENCH_PACKAGES = ("rich", "matplotlib", "httpx")  # the `bench` extra of pyproject.toml, beside `needs`
INSTALL = "pip install 'corral[bench]'"
DATA_HELP = "JSONSchemaBench root with <Subset>/*.json"
SERVER_HELP = "a running corral (default: start one as a subprocess and stop it at the end)"

Run = Callable[[argparse.Namespace, "Bench"], int]
C = TypeVar("C", bound="DataclassInstance")


class BenchExit(Exception):
    """Ends a run: `corral bench NAME: message` printed in `style`, exit status `code` (2: a refused flag)."""

    def __init__(self, message: str, code: int = 2, style: str = "red") -> None:
        super().__init__(message)
        self.code = code
        self.style = style


@contextmanager
def exit_on(errors: type[Exception] | tuple[type[Exception], ...], code: int) -> Iterator[None]:
    """`errors` raised inside end the run with their message and `code` (ValueError of a flag: 2; RuntimeError
    of a server that did not start or answer: 1)."""
    try:
        yield
    except errors as exc:
        raise BenchExit(str(exc), code) from exc


@contextmanager
def bench_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, run: Run, *, help: str, description: str,
    data: str | None = None, server: str | None = None, server_args: str | None = None,
    server_args_default: str = "", out: str | None = None, log_level: bool = False, width: int = 160,
    needs: Sequence[str] = (),
) -> Iterator[argparse.ArgumentParser]:
    """`corral bench NAME`: --data (required; `data` is its help) first, then the flags the with-block adds,
    then --server and --server-args (each when given its help; a --server-args default is shown in it), --out
    (when given its default folder) and --log-level. `run(args, bench)` runs it; `width` is the console's when
    output is not a terminal; `needs` are packages it imports beyond BENCH_PACKAGES."""
    p = sub.add_parser(name, help=help, description=description)
    if data is not None:
        p.add_argument("--data", type=Path, required=True, metavar="DIR", help=data)
    yield p
    if server is not None:
        p.add_argument("--server", default=None, metavar="URL", help=server)
    if server_args is not None:
        shown = f" (default {server_args_default!r})" if server_args_default else ""
        p.add_argument("--server-args", default=server_args_default, metavar="ARGS", help=server_args + shown)
    if out is not None:
        p.add_argument("--out", type=Path, default=Path(out), metavar="DIR", help=f"results folder (default {out})")
    if log_level:
        p.add_argument("--log-level", default="warning")
    p.set_defaults(handler=_Command(name, run, width, (*BENCH_PACKAGES, *needs), data is not None))


@dataclasses.dataclass(frozen=True)
class _Command:
    """The parser's handler: checks the packages, then runs the command with its `Bench`."""

    name: str
    run: Run
    width: int
    needs: tuple[str, ...]
    takes_data: bool

    def __call__(self, args: argparse.Namespace) -> int:
        missing = [package for package in self.needs if importlib.util.find_spec(package) is None]
        if missing:
            print(f"corral bench {self.name} needs the benchmark packages (missing: {', '.join(missing)}); install "
                  f"them with {INSTALL}", file=sys.stderr)
            return 2
        bench = Bench(self.name, _console(self.width, getattr(args, "log_level", None)), args.out)
        try:
            if self.takes_data and not args.data.is_dir():
                raise BenchExit(f"--data {args.data} is not a directory")
            return self.run(args, bench)
        except BenchExit as exc:
            bench.console.print(f"[{exc.style}]corral bench {self.name}: {exc}[/{exc.style}]")
            return exc.code


def _console(width: int, log_level: str | None) -> Any:
    """A rich console, `width` wide when not a terminal (logs and CI: wide tables stay readable); logging goes
    through it at `log_level` when the command takes one."""
    from rich.console import Console
    from rich.logging import RichHandler

    console = Console()
    if not console.is_terminal:
        console = Console(width=width)
    if log_level is not None:
        logging.basicConfig(level=log_level.upper(), format="%(message)s",
                            handlers=[RichHandler(console=console, show_path=False)])
    return console


class Bench:
    """One run of a `corral bench` command: its console, progress bar and report, written under `out`."""

    def __init__(self, name: str, console: Any, out: Path) -> None:
        self.name = name
        self.console = console
        self.out = out

    def progress(self) -> RichProgress:
        return RichProgress(self.console)

    @property
    def plot_path(self) -> Path:
        return self.out / f"{self.name}.png"

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[str]],
              left: Collection[str] | None = None) -> None:
        """Prints a table: the `left` columns (default: the first) flush left, the others flush right."""
        from rich.table import Table

        table = Table(title=title)
        left = {columns[0]} if left is None else left
        for column in columns:
            table.add_column(column, justify="left" if column in left else "right")
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    def write_results(self, config: dict[str, Any], rows: Iterable[dict[str, Any]]) -> Path:
        """OUT/results.json: the configuration, the machine and one object a row."""
        machine = {"processor": platform.processor() or platform.machine(), "python": platform.python_version()}
        return write_json(self.out, {"config": config, "machine": machine, "results": list(rows)})

    def wrote(self, *paths: Path | str, wall_s: float | None = None) -> None:
        """The closing line: the wall time (when given) and the files written."""
        wall = "" if wall_s is None else f"wall time {wall_s:.1f} s; "
        self.console.print(f"{wall}wrote {', '.join(str(p) for p in paths)}")


class RichProgress:
    """A progress bar, one line a phase (label, bar, done/total, elapsed, remaining, the last item's detail);
    what corral.benchmarks.serve.runner.Progress asks for."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[last]}"),
                                  console=console)
        self._task: Any = None

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def phase(self, label: str, total: int) -> None:
        self._task = self._progress.add_task(label, total=total, last="")

    def advance(self, detail: str = "") -> None:
        if self._task is not None:
            self._progress.update(self._task, advance=1, last=detail)


def write_json(out: Path, payload: Any, name: str = "results.json") -> Path:
    """OUT/NAME, indented, with a closing newline; values JSON lacks (paths, ...) as strings."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: PNG files, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Lays `fig` out, writes it to `path` (its folder made when missing) and closes it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


@dataclasses.dataclass(frozen=True)
class ServerBenchConfig:
    """What the benchmarks that drive a corral over HTTP share: the JSONSchemaBench folder, the results folder
    and the server (the running one at `server`, else one the benchmark starts with `server_args`)."""

    data: Path
    out: Path
    server: str | None = None
    server_args: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "data": str(self.data), "out": str(self.out)}

    def server_notes(self, url: str, command: list[str] | None) -> dict[str, Any]:
        return {"url": url, "started_by_benchmark": self.server is None, "command": command}


def config_from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """A `cls` dataclass from the flags named as its fields; `overrides` for the fields a flag does not give
    as it is (parsed lists, renamed flags)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**given, **overrides})
