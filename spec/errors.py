"""The one error type a person sees: a single line naming the thing and the fix."""


class CarveError(Exception):
    """A user-actionable failure. ``str(err)`` is one line: what (file, device, option, term)
    and what to change. Library code raises it; CLIs print it and exit 2; the GUI shows it."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
