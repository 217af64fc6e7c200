"""OpenAI's Responses API (``POST /v1/responses``): a face over the internal request (``turn``)."""
