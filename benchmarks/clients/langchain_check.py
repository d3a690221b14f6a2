"""LangChain's ChatOpenAI against a running `kvserve serve` (its own venv: pip install langchain-openai):
with_structured_output, bind_tools with a forced call and the conversation after it, stream, batch.

    python benchmarks/clients/langchain_check.py [--base-url http://127.0.0.1:8000/v1]
"""

import argparse

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--model", default="smollm2-135m")
args = parser.parse_args()
llm = ChatOpenAI(base_url=args.base_url, api_key="none", model=args.model, temperature=0, max_tokens=80)

class Pet(BaseModel):
    """A pet."""
    name: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)

pet = llm.with_structured_output(Pet).invoke("Invent a pet.")
print("with_structured_output:", repr(pet))
assert isinstance(pet, Pet)

@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"

bound = llm.bind_tools([get_weather], tool_choice="get_weather")
msg = bound.invoke("What is the weather in Paris?")
print("bind_tools:", msg.tool_calls)
assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
result = get_weather.invoke(msg.tool_calls[0]["args"])
final = llm.bind_tools([get_weather]).invoke([HumanMessage("What is the weather in Paris?"), msg,
                                                ToolMessage(result, tool_call_id=msg.tool_calls[0]["id"])])
print("after the tool:", repr(final.content))
print("stream:", "".join(c.content for c in llm.stream("Say hi")))
print("batch:", [m.content[:20] for m in llm.batch(["Say one", "Say two"])])
