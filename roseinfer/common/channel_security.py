"""Authentication and encryption of the engine's channels to ranks on other hosts (ZeroMQ CURVE).

Over TCP anyone who reaches host 0 could otherwise subscribe to every SchedulerOutput (every
prompt), push replies (tokens into another user's answer) or kill the workers. Every host is
started with the same secret (`$ROSEINFER_TP_SECRET`, like torchrun's rendezvous settings, never on
a command line); both CURVE key pairs are derived from it, and host 0 admits only clients that
prove the client key (a ZAP handler), so a peer without the secret can neither listen nor speak.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

import zmq
import zmq.auth.thread

from roseinfer.errors import InvalidRequestError

SECRET_ENV = "ROSEINFER_TP_SECRET"
_MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _key_pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    raw = hashlib.blake2b(secret, digest_size=32, person=b"roseinfer-curve", salt=role.ljust(16, b"\0")).digest()
    secret_key = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def channel_keys() -> CurveKeys:
    """The key pairs from $ROSEINFER_TP_SECRET; a clear error where it is missing or short."""
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < _MIN_SECRET_CHARS:
        raise InvalidRequestError(
            f"ranks on several hosts need a shared secret of at least {_MIN_SECRET_CHARS} characters in "
            f"${SECRET_ENV} on every host (e.g. `export {SECRET_ENV}=$(openssl rand -hex 32)` on one, copied "
            "to the others): it authenticates and encrypts the engine's messages to the other hosts",
            "nnodes",
        )
    if not zmq.has("curve"):
        raise InvalidRequestError("this pyzmq's libzmq has no CURVE support, which ranks on several hosts need",
                                  "nnodes")
    server_public, server_secret = _key_pair(secret.encode(), b"server")
    client_public, client_secret = _key_pair(secret.encode(), b"client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


class _OnlyOurClients:
    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:  # key: z85, as pyzmq hands it over
        return hmac.compare_digest(key, self.client_public)


def start_authenticator(context: zmq.Context, keys: CurveKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """Host 0's ZAP handler: a CURVE client is admitted only with the key derived from the secret."""
    authenticator = zmq.auth.thread.ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_OnlyOurClients(keys.client_public))
    return authenticator


def make_server(socket: zmq.Socket, keys: CurveKeys) -> None:
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    socket.curve_server = True


def make_client(socket: zmq.Socket, keys: CurveKeys) -> None:
    socket.curve_secretkey = keys.client_secret
    socket.curve_publickey = keys.client_public
    socket.curve_serverkey = keys.server_public
