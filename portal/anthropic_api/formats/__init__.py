"""Anthropic Message Batches to and from Batchery job files: the pure conversions behind `/v1/messages/batches`.

`requests` turns one batch request's Messages API params into a chat record and the engine's params;
`results` turns a line of the job's merged output into Anthropic's result line. No Django here.
"""
