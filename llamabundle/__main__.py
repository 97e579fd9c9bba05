"""`python -m llamabundle`: the same command line as the `llamabundle` program."""

from .cli import main

main()
