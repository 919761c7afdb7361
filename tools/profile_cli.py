"""`strata-profile`: routing counts -> expert-profile.bin, which decides the GPU-resident experts.

The entry point exists so that installs and `--help` can be checked; the command itself arrives
with the GPU expert tier (issue 6) and says so rather than printing a plausible empty report.
"""

from __future__ import annotations

import sys

import typer

from strata.engine.cli import run_app

app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0].strip("`"))


@app.command()
def profile(pack: str = typer.Argument(..., help="the pack directory")) -> None:
    typer.echo("strata-profile: not built yet (the GPU expert tier, issue 6)", err=True)
    raise typer.Exit(2)


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv, "strata-profile")


if __name__ == "__main__":
    sys.exit(main())
