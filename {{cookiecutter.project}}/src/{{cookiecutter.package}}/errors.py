"""The one exception type that reaches the person running the job."""


class RunError(Exception):
    """A problem the person running the job can fix: printed as one line, without a traceback.

    The message says what was asked, what was found, and what to type instead.
    """
