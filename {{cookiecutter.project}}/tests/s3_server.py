"""moto's S3 server, with S3's promise that a conditional write is atomic: moto checks a PUT's
If-Match or If-None-Match and then writes, in a thread per request, so that another write to the key
can land in between and be overwritten by one whose condition no longer held. A run's claim on its
remote folder (engine/checkpoint/remote/claim.py) rests on that promise: with moto's gap, another
machine's takeover could vanish under this machine's renewal. Run as `python s3_server.py <moto.server's
arguments>`."""

import sys
import threading

from moto.s3.responses import S3Response
from moto.server import main

one_write_at_a_time = threading.Lock()
checked_then_written = S3Response.put_object


def put_object(self: S3Response):
    with one_write_at_a_time:
        return checked_then_written(self)


S3Response.put_object = put_object

if __name__ == "__main__":
    main(sys.argv[1:])
