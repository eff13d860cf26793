-- Budget periods (prepended to admit.lua and settle.lua), as state/base.py computes them in
-- integer milliseconds: `30d` is a calendar month (from the 1st), whole weeks count from Monday
-- (1970-01-01 was a Thursday), anything else from the Unix epoch; all at 00:00 UTC.
local DAY, WEEK = 86400000, 604800000
local MONTH, MONDAY = 30 * DAY, 3 * DAY
local function month_of(ms)  -- months since 1970-01 (the civil date of a day number)
  local z = math.floor(ms / DAY) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return (y - 1970) * 12 + m - 1
end
local function first_of_month(idx)  -- ms at 00:00 UTC on the 1st of month idx
  local y, m = 1970 + math.floor(idx / 12), idx % 12 + 1
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local doy = math.floor((153 * ((m + 9) % 12) + 2) / 5)
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return (era * 146097 + doe - 719468) * DAY
end
local function calendar_aligned(p) return p > 0 and (p == MONTH or p % WEEK == 0) end
local function period_index(ms, p)
  if p <= 0 then return 0 end
  if p == MONTH then return month_of(ms) end
  if p % WEEK == 0 then return math.floor((ms + MONDAY) / p) end
  return math.floor(ms / p)
end
local function period_start(idx, p)
  if p == MONTH then return first_of_month(idx) end
  if p % WEEK == 0 then return idx * p - MONDAY end
  return idx * p
end
