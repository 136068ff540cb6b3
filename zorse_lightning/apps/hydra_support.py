"""What every Hydra app of the project shares.

- where the shipped configs live (inside the package, so an installed copy finds them);
- registering the structured-config schemas in Hydra's ConfigStore before composing;
- a warning when a user's ``--config-dir`` holds a file that a shipped config shadows
  (Hydra searches the user's directory *after* the shipped one and would silently
  ignore it);
- user errors printed as one message with a non-zero exit, no traceback; a command line
  or config file that Hydra refuses while composing exits with the same code.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zorse_lightning.errors import ZorseUserError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
"""The shipped config groups (``conf/`` at the top of a checkout links here)."""

USER_ERROR_EXIT_CODE = 2


def register_schemas() -> None:
    """Put the structured-config schemas into Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from zorse_lightning.apps.planner_options import register_planner_schema
    from zorse_lightning.cluster.config import register_cluster_schema

    register_cluster_schema(ConfigStore.instance())
    register_planner_schema(ConfigStore.instance())


def shadowed_user_configs(choices: dict[str, Any], config_sources: list[Any], shipped: Path = CONF_DIR) -> list[str]:
    """User config files (from ``--config-dir``) that a shipped file of the same name hides."""
    shadowed = []
    for source in config_sources:
        if source.provider != "command-line" or source.schema != "file":
            continue
        user_dir = Path(source.path)
        for group, option in choices.items():
            if not isinstance(option, str) or group.startswith("hydra"):
                continue
            relative = Path(*group.split("/")) / f"{option}.yaml"
            if (user_dir / relative).is_file() and (shipped / relative).is_file():
                shadowed.append(str(user_dir / relative))
    return shadowed


def warn_about_shadowed_configs() -> None:
    from hydra.core.hydra_config import HydraConfig

    runtime = HydraConfig.get().runtime
    for path in shadowed_user_configs(dict(runtime.choices), list(runtime.config_sources)):
        warnings.warn(
            f"{path} has the name of a shipped config, and Hydra uses the shipped one: "
            f"rename your file (and the name you pass on the command line) to use it",
            stacklevel=2,
        )


def report_user_errors(task: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``task``; a :class:`ZorseUserError` becomes a one-line message and exit code 2."""

    @functools.wraps(task)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            warn_about_shadowed_configs()
            return task(*args, **kwargs)
        except ZorseUserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(USER_ERROR_EXIT_CODE)

    return wrapper


def run_app(task: Callable[[Any], Any], config_name: str) -> None:
    """Run ``task`` as the Hydra app of the shipped config ``config_name``, schemas registered.

    Hydra prints its reason and exits with 1 when it refuses the command line or a config
    file while composing (a misspelt option, a value of the wrong type, a missing file):
    that is the user's to fix, so, before the task has started, it exits with
    :data:`USER_ERROR_EXIT_CODE` like the task's own user errors. Once the task has
    started, Hydra's 1 means a bug and is kept.
    """
    import hydra

    register_schemas()
    started = False

    @functools.wraps(task)
    def marked(cfg: Any) -> Any:
        nonlocal started
        started = True
        return task(cfg)

    try:
        hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(marked)()
    except SystemExit as exit_:
        if exit_.code == 1 and not started:
            print(
                "error: Hydra refused the command line or a config file (reason above); fix the option or "
                "value it names (`--cfg job` prints the composed config, every option with its value)",
                file=sys.stderr,
            )
            sys.exit(USER_ERROR_EXIT_CODE)
        raise
