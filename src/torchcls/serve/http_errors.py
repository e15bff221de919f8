"""HTTP errors with a status code; answered as the protocol's `{"error": "..."}` JSON body."""


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
