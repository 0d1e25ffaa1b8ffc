#pragma once
/// Header-only or compiled (docs/design/compiled-mode.md). By default every definition is in the
/// headers: include and go. With TRAINKIT_COMPILED_LIB defined (the CMake target
/// trainkit::compiled sets it for its users) the non-template definitions, kept in the -inl.hpp
/// files beside their headers, are compiled once, in src/trainkit.cpp, and a program's files see
/// their declarations alone. Every file of a program is built in the same mode.
#ifdef TRAINKIT_COMPILED_LIB
#define TRAINKIT_INLINE
#else
#define TRAINKIT_INLINE inline
#endif

/// The parallel/ layer (ProcessGroup, DataParallel, the heartbeat) needs Gloo's headers, which a
/// LibTorch wheel does not ship. Its definitions are compiled with the rest only where
/// trainkit::compiled was configured with them found: the target then also defines
/// TRAINKIT_COMPILED_PARALLEL for its users. Elsewhere they stay in the headers in both modes.
#if defined(TRAINKIT_COMPILED_LIB) && defined(TRAINKIT_COMPILED_PARALLEL)
#define TRAINKIT_PARALLEL_INLINE
#else
#define TRAINKIT_PARALLEL_INLINE inline
#endif
