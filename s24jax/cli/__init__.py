"""The commands a user runs (`python -m s24jax.cli.<command>`), over the library; nothing in the
library imports this package. command.py and args.py: the one error path and the argument
checks they all share. This __init__ imports nothing (a command's startup stays fast until it
has guarded itself: command.guard_startup)."""
