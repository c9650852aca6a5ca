"""``python -m kvrouter`` runs the command-line interface."""

from kvrouter.cli import main

main()
