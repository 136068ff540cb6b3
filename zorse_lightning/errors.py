"""Errors a user can act on.

Every check of user input (inventories, plans, options) raises a subclass of
:class:`ZorseUserError` with a message that names the field, the value, the
rule and the fix. The entry points print such errors without a traceback and
exit non-zero; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ZorseUserError(ValueError):
    """Bad input from the user: the message says what is wrong and what to do."""


class InventoryError(ZorseUserError):
    """A cluster inventory that cannot describe a real cluster."""


class PlanningError(ZorseUserError):
    """No plan satisfies the request (memory, pins, or a malformed plan)."""
