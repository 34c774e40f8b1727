// Environment values that nn reads, parsed one way for every backend: the
// CPU and CUDA switches take the same spellings and warn alike on others.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace ddp::nn {

/// An on/off variable `name` whose value is `text`: nullopt when `text` is
/// null or empty; true for 1, on, true or yes, false for 0, off, false, no
/// or none, in any case. Anything else is nullopt too and sets `*problem`
/// to a sentence naming the variable, the value and the spellings taken
/// (without what the caller keeps instead, which it adds).
std::optional<bool> ParseOnOff(const char* name, const char* text, std::string* problem);

/// A whole number of seconds in [1, `most`] for the variable `name` whose
/// value is `text`: nullopt when `text` is null or empty; anything else
/// (a sign, a unit, spaces, 0, past `most`) is nullopt and sets `*problem`
/// as ParseOnOff does.
std::optional<int64_t> ParseSeconds(const char* name, const char* text, int64_t most, std::string* problem);

/// ParseOnOff of getenv(name): `fallback` when unset, empty or not taken;
/// a value not taken prints "[ddp] warning: ...; keeping <kept>" on stderr.
bool OnOffFromEnv(const char* name, bool fallback, const std::string& kept);

}  // namespace ddp::nn
