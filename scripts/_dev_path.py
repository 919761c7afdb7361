"""Make `import strata.*` work from a plain checkout, without `pip install` (a machine with no
package index, e.g. the GPU box scripts/gpu_suite.sh runs on).

The import names are namespaced by pyproject's `package-dir` (strata.engine -> engine/, ...), so
adding the checkout to sys.path is not enough. `install(root)` adds a finder that maps exactly
those names, read from pyproject.toml (one source). Two ways to use it:

    python3 scripts/_dev_path.py DIR      # writes DIR/sitecustomize.py; then PYTHONPATH=DIR:... python3 ...
    import _dev_path; _dev_path.install(ROOT)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import tomllib
from pathlib import Path


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, packages: dict[str, Path]):
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        folder = self.packages.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def package_dirs(root: Path) -> dict[str, Path]:
    cfg = tomllib.loads((root / "pyproject.toml").read_text())
    return {name: (root / rel).resolve() for name, rel in cfg["tool"]["setuptools"]["package-dir"].items()}


def install(root: str | Path) -> None:
    """Map the project's packages to the checkout at `root` (first on the meta path: an installed
    copy of strata elsewhere must not win)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(package_dirs(Path(root).resolve())))


def write_sitecustomize(folder: Path, root: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "sitecustomize.py"
    out.write_text(
        "# written by scripts/_dev_path.py: maps strata.* to a plain checkout\n"
        "import importlib.util as _u\n"
        f"_s = _u.spec_from_file_location('_strata_dev_path', {str(Path(__file__).resolve())!r})\n"
        "_m = _u.module_from_spec(_s)\n"
        "_s.loader.exec_module(_m)\n"
        f"_m.install({str(root)!r})\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python3 scripts/_dev_path.py DIR   (writes DIR/sitecustomize.py; put DIR on PYTHONPATH)", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parent.parent
    print(write_sitecustomize(Path(argv[0]), root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
