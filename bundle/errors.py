"""The one refusal of a bundle: whichever check of whichever file found it, the caller gets a
:class:`BundleError` naming the file and the reason."""


class BundleError(RuntimeError):
    """The bundle is missing, corrupt or inconsistent; the message says which part."""
