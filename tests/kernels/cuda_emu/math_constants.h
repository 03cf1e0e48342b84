#pragma once
// CPU emulation shim: see emu.h.
#include "emu.h"
