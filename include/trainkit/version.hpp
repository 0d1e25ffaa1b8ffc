#pragma once
/// trainkit's version; bumped with every release that changes the checkpoint format or the API.
#define TRAINKIT_VERSION_MAJOR 0
#define TRAINKIT_VERSION_MINOR 1
#define TRAINKIT_VERSION_PATCH 0

#define TRAINKIT_DETAIL_STR2(x) #x
#define TRAINKIT_DETAIL_STR(x) TRAINKIT_DETAIL_STR2(x)
/// "MAJOR.MINOR.PATCH", for logs and checkpoints.
#define TRAINKIT_VERSION_STRING                                          \
  TRAINKIT_DETAIL_STR(TRAINKIT_VERSION_MAJOR)                            \
  "." TRAINKIT_DETAIL_STR(TRAINKIT_VERSION_MINOR) "." TRAINKIT_DETAIL_STR( \
      TRAINKIT_VERSION_PATCH)
