"""TEMPORARY (issue 28 A/B, removed before the last commit): ORBIT_TMP_OFF=a,b turns changes off."""

import os

OFF = frozenset(os.environ.get("ORBIT_TMP_OFF", "").split(","))
