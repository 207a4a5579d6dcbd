"""The one exception type that featcal raises for problems the user can fix."""


class FeatcalError(Exception):
    """A problem with the user's input or environment, with a message that names the fix.

    The CLI prints the message on one line and exits with status 2; library users catch it.
    """
