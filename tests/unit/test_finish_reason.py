"""The abort finish reason names an error type that matches its status: a failed transfer (5xx) is an
InternalServerError, never a BadRequestError."""

from tokenloom.finish_reason import finish_abort


def test_abort_error_type_follows_the_status():
    assert finish_abort("bad", 400)["err_type"] == "BadRequestError"
    assert finish_abort("full", 503)["err_type"] == "ServiceUnavailableError"
    transfer = finish_abort("KV transfer failed", 500)
    assert transfer == {"type": "abort", "message": "KV transfer failed", "status_code": 500,
                        "err_type": "InternalServerError"}
    assert finish_abort("custom", 400, "InvalidRequestError")["err_type"] == "InvalidRequestError"
