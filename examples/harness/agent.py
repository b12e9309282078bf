"""A command harness: it asks the model one question through the recording gateway and
prints the answer. The rollout consumer's HarnessSource runs it once per session with, in
its environment, OPENAI_BASE_URL (its session's URL on the gateway), OPENAI_API_KEY (a
dummy) and ROLLSTREAM_TASK (the task's payload as JSON); its stdout is the session's output,
which the verifier (scoring.py) scores. Any program that speaks the OpenAI API will do.
"""

import json
import os

from openai import OpenAI

task = json.loads(os.environ["ROLLSTREAM_TASK"])  # this run's tasks: {"prompt": "c:3=", "answer": "3"}
client = OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY; a failed call is the gateway's to report
reply = client.chat.completions.create(
    model="tiny", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=1)
print(reply.choices[0].message.content)
