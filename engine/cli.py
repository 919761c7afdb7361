"""`strata`: the engine's command line.

Thin on purpose (STYLE: library code never reads argv or prints): each subcommand parses its flags
and calls into the engine. `strata generate` arrives with the engine core (issue 4); until then the
entry point exists so that installs and `--help` can be checked.
"""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Strata engine: run a packed MoE model (dense weights and hot experts on the GPU, the rest on the CPU).",
)


@app.command()
def generate() -> None:
    """Generate text from a pack (not built yet: the engine core is issue 4)."""
    typer.echo("strata generate: the engine core is not built yet (issue 4)", err=True)
    raise typer.Exit(2)


@app.command()
def version() -> None:
    """Print the Strata version."""
    from strata import __version__

    typer.echo(__version__)


def run_app(typer_app: typer.Typer, argv: list[str] | None, prog_name: str) -> int:
    """Run a typer app and return its exit status (click exits; every CLI here returns a code)."""
    try:
        typer_app(args=argv, prog_name=prog_name)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv, "strata")


if __name__ == "__main__":
    sys.exit(main())
