"""`strata-budget`: the VRAM report, from the pack alone, that matches what the engine allocates.

The entry point exists so that installs and `--help` can be checked; the command itself arrives
with the GPU expert tier (issue 6) and says so rather than printing a plausible empty report.
"""

from __future__ import annotations

import sys

import typer

from strata.engine.cli import run_app

app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0].strip("`"))


@app.command()
def budget(pack: str = typer.Argument(..., help="the pack directory")) -> None:
    typer.echo("strata-budget: not built yet (the GPU expert tier, issue 6)", err=True)
    raise typer.Exit(2)


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv, "strata-budget")


if __name__ == "__main__":
    sys.exit(main())
