"""`carve serve` and the window's Serve switch: an OpenAI-compatible HTTP server in front of the
one engine process (starlette + uvicorn). No torch, no Qt outside ``app/widgets``: the server
drives the engine through its protocol only.

    openai_api.py   request bodies -> a Job (validated), replies and errors in OpenAI's shapes
    stop_text.py    stop strings cut from streamed text
    engine_turns.py requests take turns on the one engine (asyncio side)
    http.py         the starlette routes and the uvicorn server around them
"""
