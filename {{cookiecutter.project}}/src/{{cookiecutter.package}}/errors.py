"""The one exception type that reaches the person running the job, and errors said in one line."""


class RunError(Exception):
    """A problem the person running the job can fix: printed as one line, without a traceback.

    The message says what was asked, what was found, and what to type instead.
    """


def first_line(error: BaseException) -> str:
    """What `error` says, in one line."""
    # SQLAlchemy (MLflow's sqlite store) puts its own notes ("raised as a result of Query-invoked
    # autoflush") before what the database said, which its DBAPIError keeps as `orig`.
    if isinstance(getattr(error.__cause__, "orig", None), BaseException):
        error = error.__cause__.orig
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
