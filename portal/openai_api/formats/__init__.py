"""OpenAI Batch API files to and from Batchery job files: the pure conversions behind ``/v1/batches``.

`endpoints` names the endpoints a batch may target and the model task serving each; `input_file` checks
an uploaded batch input file and writes the job's records (`convert_requests`); `output_file` turns the
job's output into OpenAI's output and error files (`convert_outputs`).

No Django here: the views and tasks hand these functions open files.
"""
