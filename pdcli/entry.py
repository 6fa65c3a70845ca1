"""The `pd` console script: the command in a process whose heap is the workers' (it starts
itself again first where needed, before the commands and torch are imported:
`pdcli.torchutil.allocator.restart_on_huge_pages`)."""

from __future__ import annotations


def main() -> None:
    from pdcli.torchutil.allocator import restart_on_huge_pages

    restart_on_huge_pages()
    from pdcli.cli import main as cli_main

    cli_main()
