"""User-facing errors: one clear message, exit status 2, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, infeasible plan).

    The CLI prints `error: <message>` (plus `hint: <hint>` when given) and exits `exit_code`
    (2). Anything that is not a UserError is a bug and keeps its traceback.
    """

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class ConfigError(UserError):
    """One or more problems in a config; `problems` lists them all."""

    def __init__(self, problems: list[str], hint: str | None = None) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the config:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(message, hint)


class RunFailed(UserError):
    """A run pd started failed (a worker died or hung), not the user's input: the same one clear
    message, exit status 1 as a failed `pd train`."""

    exit_code = 1
