"""JSON schemas that constrained samples of the tiny random models are checked against."""

# Strings are patterned or enums: a random model would otherwise write strings of hundreds of
# tokens. Together they cover nested objects, enums, arrays, integers and booleans.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "admin": {"type": "boolean"},
                },
                "required": ["id", "admin"],
            },
            "level": {"enum": ["low", "mid", "high"]},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["user", "level", "scores"],
    },
]
