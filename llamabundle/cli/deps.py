"""`llamabundle deps [--json] FILE...`: the runtime closure of PE or ELF binaries, each library with its
class and where it was found.

click only: parse, call deps.pe / deps.elf, print (`elf.closure_report` puts the ELF closure in the shape of
deps.pe's JSON, so that both formats print alike)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UsageError, VerifyError
from .options import JSON_OPT
from .output import emit, with_report


@click.command("deps")
@click.argument("files", metavar="FILE...", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--search", "search", metavar="DIR", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="Also look for libraries here (e.g. a mingw sysroot bin, the MSVC redist, the CUDA toolkit bin); repeatable.")
@JSON_OPT
def deps_command(files: tuple[Path, ...], search: tuple[Path, ...], as_json: bool) -> None:
    """Print the runtime closure of PE or ELF binaries: each library's class and where it was found.

    Libraries are looked up in the binaries' own directory (the bundle), then in each --search DIR."""
    from ..deps import elf, pe

    paths = [f.resolve() for f in files]
    for f, p in zip(files, paths, strict=True):
        if not p.is_file():  # a FIFO or device: never opened (reading a FIFO blocks)
            raise UsageError(f"{f} is not a regular file", fix="pass .exe/.dll or ELF files")
    if len({p.parent for p in paths}) > 1:
        raise UsageError("the files are in different directories",
                         fix="pass binaries of one bundle directory (use --search for other places)")
    kinds = {"pe" if pe.is_pe(p) else "elf" if elf.is_elf(p) else "?" for p in paths}
    if kinds - {"pe", "elf"} or len(kinds) > 1:
        bad = next((p for p in paths if not (pe.is_pe(p) or elf.is_elf(p))), None)
        raise UsageError(f"{bad.name} is neither a PE nor an ELF binary" if bad else "the files mix PE and ELF binaries",
                         fix="pass the .exe/.dll files of a Windows bundle or the ELF files of a Linux one")
    if kinds == {"pe"}:
        info = pe.resolve_closure(paths, bundle_dir=paths[0].parent, extra_dirs=list(search)).to_json()
    else:
        info = elf.closure_report(paths, list(search))
    missing = ([VerifyError(f"{len(info['missing'])} of the libraries these binaries need were not found: "
                            + ", ".join(f"{name} (needed by {', '.join(by)})" for name, by in info["missing"].items()),
                            why="they are neither beside the binaries, in a --search directory, nor system or driver libraries",
                            fix="copy them beside the binaries, or pass the directory that has them with --search")]
               if info["missing"] else [])
    if as_json:
        if missing:
            raise with_report(missing[0], info)
        emit(info)
        return
    width = max([len(d["name"]) for d in info["deps"]] + [20])
    click.echo(f"{'library':<{width}}  {'class':<13}  found")
    for d in info["deps"]:
        kind = f" ({d['kind']})" if d["kind"] and d["kind"] != d["class"] else ""
        delay = "  [delay-load]" if d["delay_only"] else ""
        click.echo(f"{d['name']:<{width}}  {d['class']:<13}  {d['path'] or '-'}{kind}{delay}  <- {', '.join(d['imported_by'])}")
    click.echo(f"system deps: {', '.join(info['system_deps']) or '-'}")
    for name, by in info["missing"].items():
        click.echo(f"missing: {name} (needed by {', '.join(by)})")
    if missing:
        raise missing[0]


COMMANDS: tuple[click.Command, ...] = (deps_command,)
