"""``python -m orbit_server`` is ``orbit-server``."""

from orbit_server.cli import main

main(prog_name="orbit-server")
